"""How a setting is declared, once, on the dataclass it fills: its flag, help, panel, bounds,
and whether the environment and the config file may set it too.

The command line builds its options from these declarations (cli/options.py), the config file
and the environment check their keys and types against them (user_config.py), the settings
validate their values by them, and the server's request models take their bounds from them.
Nothing here imports typer or pydantic: the declarations are plain data.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass
from typing import Any

from llmcli.errors import UsageError


@dataclass(frozen=True)
class Bounds:
    """A numeric range, written as people read it: ≥ 0, in (0, 1], in 0…N."""

    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None
    note: str = ""  # what a special value means: "0 turns it off"

    def holds(self, value: float) -> bool:
        # value != value: NaN; value − value != 0: an infinity (no setting either)
        if value != value or value - value != 0:
            return False
        return (
            (self.ge is None or value >= self.ge)
            and (self.gt is None or value > self.gt)
            and (self.le is None or value <= self.le)
            and (self.lt is None or value < self.lt)
        )

    def rule(self) -> str:
        low = f"[{_number(self.ge)}" if self.ge is not None else f"({_number(self.gt)}"
        if self.lt is not None and self.ge is not None and isinstance(self.lt, int):
            text = f"in {_number(self.ge)}…{self.lt - 1}"
        elif self.le is not None:
            text = f"in {low}, {_number(self.le)}]"
        elif self.ge is not None:
            text = f"≥ {_number(self.ge)}"
        else:
            text = f"> {_number(self.gt)}"
        return f"{text} ({self.note})" if self.note else text

    def pydantic(self) -> dict[str, float]:
        """The same range as pydantic's Field keywords, for the server's request models."""
        keys = ("ge", "gt", "le", "lt")
        return {key: getattr(self, key) for key in keys if getattr(self, key) is not None}


def _number(value: float | None) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


@dataclass(frozen=True)
class Declared:
    """One setting's declaration. `flags` are its command-line spellings (default: --the-name);
    `key` is its name in the config file and after LLMCLI_ (default: the field's name), when
    `layered` (flag > environment > config file); `cli_type` is what the flag reads when it
    differs from the field (--max-memory reads "8GB" into bytes, --stop a list into a tuple)."""

    help: str
    panel: str | None
    flags: tuple[str, ...] = ()
    layered: bool = False
    key: str | None = None
    bounds: Bounds | None = None
    choices: tuple[str, ...] = ()
    cli_type: Any = None
    cli_default: Any = "field"  # the flag's default when it differs from the field's ("field": the same)
    show_default: bool = True
    envvar: str | None = None  # read by the flag itself (LLMCLI_SERVER), not through the layers
    parse: Any = None  # text → the field's value (--max-memory 8GB → bytes); ValueError if it is not
    builtin: Any = None  # the value when no layer gives one (sampling: after the model's own)
    suggest: tuple[str, ...] = ()  # what shell completion offers when `choices` is not the whole story


def setting(default: Any = None, **declaration: Any) -> Any:
    """A dataclass field carrying its declaration."""
    return dataclasses.field(default=default, metadata={"declared": Declared(**declaration)})


def declarations(settings_class: type) -> dict[str, Declared]:
    """Field name → declaration, in the order the class declares them."""
    return {
        f.name: f.metadata["declared"] for f in dataclasses.fields(settings_class) if "declared" in f.metadata
    }


def completions_of(declared: Declared) -> tuple[str, ...]:
    """The values shell completion offers for a setting's flag."""
    return declared.suggest or declared.choices


def key_of(name: str, declared: Declared) -> str:
    return declared.key or name


def flag_of(name: str, declared: Declared) -> str:
    """The flag a message names: the long spelling."""
    long = [flag for flag in declared.flags if flag.startswith("--")]
    return long[0].split("/")[0] if long else "--" + key_of(name, declared).replace("_", "-")


def setting_name(key: str, where: str = "flag", flag: str | None = None) -> str:
    """A setting as the user wrote it: --top-p (a flag), LLMCLI_TOP_P (the environment), top_p
    in a config file's section, or top_p in a server request."""
    if where == "flag":
        return flag or "--" + key.replace("_", "-")
    if where == "env":
        return f"LLMCLI_{key.upper()}"
    if where == "request":  # a server request's field
        return key
    return f"{key} ({where})"


def check_bounds(settings: Any, where: str = "flag") -> None:
    """Every declared bound and choice of `settings`, with the value's source in the message."""
    for name, declared in declarations(type(settings)).items():
        value = getattr(settings, name)
        if value is None:
            continue
        label = setting_name(key_of(name, declared), where, flag_of(name, declared))
        if declared.bounds is not None and not declared.bounds.holds(value):
            raise UsageError(f"{label} must be {declared.bounds.rule()}, got {value}")
        if declared.choices and value not in declared.choices:
            raise UsageError(f"{label} must be one of {', '.join(declared.choices)}, got {value!r}")


def layered_types(*settings_classes: type) -> dict[str, type]:
    """Every key the environment and config file may set, and its type."""
    types: dict[str, type] = {}
    for settings_class in settings_classes:
        hints = field_types(settings_class)
        for name, declared in declarations(settings_class).items():
            if declared.layered:
                types[key_of(name, declared)] = hints[name]
    return types


def field_types(settings_class: type) -> dict[str, type]:
    """The plain type each field holds: int, float, str, bool, or list for a sequence."""
    return {name: _plain(hint) for name, hint in typing.get_type_hints(settings_class).items()}


def _plain(hint: Any) -> type:
    """float | None → float; tuple[str, ...] → list."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        hint = next(arg for arg in typing.get_args(hint) if arg is not type(None))
    origin = typing.get_origin(hint) or hint
    return list if origin in (tuple, list) else origin
