"""The user's config file: default model, default settings, aliases, per-model overrides.

    # ~/.config/llmcli/config.toml  ($XDG_CONFIG_HOME/llmcli, or the file $LLMCLI_CONFIG names)
    model = "smollm2"                    # the default model: an alias, Hub id, folder or .gguf
    keep_alive = "10m"                   # a setting above every table: as if in [defaults]

    [defaults]                           # for every model
    temperature = 0.7
    max_new_tokens = 256

    [aliases]
    qwen = "Qwen/Qwen2.5-0.5B-Instruct"  # (a Hub model: its first use downloads it)

    [models.smollm2]                     # for one model: any name -m or `models list` knows it by
    system = "You are terse."
    temperature = 0.2
    ctx = 2048

Precedence, highest first: flag > environment (LLMCLI_MODEL, LLMCLI_TEMPERATURE, …) > the
model's section > [defaults] (or the top level) > the model's generation_config.json > built-in.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from llmcli.config.declare import layered_types
from llmcli.config.settings import LAYERED_GROUPS
from llmcli.errors import UsageError

if sys.version_info >= (3, 11):
    pass
else:  # pragma: no cover - Python 3.10
    pass


def setting_types() -> dict[str, type]:
    """Every key a [defaults] or [models."…"] section (or LLMCLI_<KEY>) may set, and its type:
    the settings declared layered (config/settings.py)."""
    return layered_types(*LAYERED_GROUPS)


TOP_LEVEL = {"model", "defaults", "aliases", "models"}


def config_path() -> Path:
    explicit = os.environ.get("LLMCLI_CONFIG")
    if explicit:
        return Path(explicit).expanduser()
    base = os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config"
    return Path(base).expanduser() / "llmcli" / "config.toml"


@dataclass(frozen=True)
class UserConfig:
    path: Path
    model: str | None = None
    defaults: dict[str, Any] = field(default_factory=dict)
    top_level: dict[str, Any] = field(default_factory=dict)  # settings written above every table
    aliases: dict[str, str] = field(default_factory=dict)
    models: dict[str, dict[str, Any]] = field(default_factory=dict)

    def expand(self, spec: str | None, builtin: Callable[[str], str] | None = None) -> str | None:
        """An alias → what it stands for (aliases may not chain), then `builtin` (the model
        layer's own names, handed in: this layer does not know them); anything else as it is."""
        if not spec:
            return spec
        spec = self.aliases.get(spec, spec)
        return builtin(spec) if builtin else spec

    def section_for(self, names: list[str]) -> str | None:
        """The [models."…"] section for the model that goes by `names` (what -m, `models list`
        and the aliases call it), compared without case; None when no section names it. Two
        sections for one model are refused: which one would win is not for llmcli to guess."""
        wanted = {name.lower() for name in names}
        wanted |= {alias.lower() for alias, target in self.aliases.items() if target.lower() in wanted}
        matches = [section for section in self.models if section.lower() in wanted]
        if len(matches) > 1:
            raise UsageError(
                f"{self.path}: sections {', '.join(repr(m) for m in matches)} name the same model",
                "keep one of them",
            )
        return matches[0] if matches else None

    def for_model(self, name: str) -> dict[str, Any]:
        return self.models.get(name, {})


def load_user_config(path: Path | None = None) -> UserConfig:
    """The config file, checked; an empty config when there is none. Errors name file and line."""
    path = path or config_path()
    if not path.is_file():
        if os.environ.get("LLMCLI_CONFIG"):
            what = "a folder" if path.is_dir() else "something that does not exist"
            raise UsageError(f"LLMCLI_CONFIG names {path}, {what}: it must name a TOML file")
        return UserConfig(path=path)
    from llmcli.reading import CONFIG_BYTES, parse_toml, read_text

    data = parse_toml(read_text(path, CONFIG_BYTES, str(path)), str(path))
    unknown = set(data) - TOP_LEVEL - set(setting_types())
    if unknown:
        raise UsageError(
            f"{path}: unknown key {sorted(unknown)[0]!r} "
            f"(known: {', '.join(sorted(TOP_LEVEL))}, and any setting [defaults] may hold)"
        )
    model = data.get("model")
    if model is not None and not isinstance(model, str):
        raise UsageError(f"{path}: 'model' must be a string")
    aliases = data.get("aliases", {})
    if not isinstance(aliases, dict) or not all(isinstance(v, str) for v in aliases.values()):
        raise UsageError(f"{path}: [aliases] must map names to model strings")
    models = data.get("models", {})
    if not isinstance(models, dict):
        raise UsageError(f"{path}: [models] must hold one table per model")
    # A setting above every table (`keep_alive = "10m"` as the README writes it) holds for every
    # model, as [defaults] does; the same key in both places would leave the winner to guess.
    top_level = _checked_settings(path, "top-level", {k: v for k, v in data.items() if k not in TOP_LEVEL})
    defaults = _checked_settings(path, "[defaults]", data.get("defaults", {}))
    if twice := sorted(set(top_level) & set(defaults)):
        raise UsageError(f"{path}: {twice[0]!r} is set both at the top level and in [defaults]", "keep one")
    return UserConfig(
        path=path,
        model=model,
        defaults=defaults,
        top_level=top_level,
        aliases=dict(aliases),
        models={name: _checked_settings(path, f'[models."{name}"]', table) for name, table in models.items()},
    )


def _checked_settings(path: Path, section: str, table: Any) -> dict[str, Any]:
    if not isinstance(table, dict):
        raise UsageError(f"{path}: {section} must be a table of settings")
    for key, value in table.items():
        known = setting_types()
        expected = known.get(key)
        if expected is None:
            raise UsageError(f"{path}: {section} has unknown setting {key!r} (known: {', '.join(known)})")
        ok = isinstance(value, expected) and not (expected in (int, float) and isinstance(value, bool))
        if expected is float and isinstance(value, int) and not isinstance(value, bool):
            ok = True
        if not ok:
            raise UsageError(f"{path}: {section} {key} must be {expected.__name__}, got {value!r}")
    return dict(table)


def env_settings() -> dict[str, Any]:
    """LLMCLI_TEMPERATURE, LLMCLI_TOP_K, … LLMCLI_SPECULATIVE: settings from the environment."""
    from llmcli.config.escapes import unescape

    values: dict[str, Any] = {}
    for key, kind in setting_types().items():
        raw = os.environ.get(f"LLMCLI_{key.upper()}")
        if raw is None or raw == "":
            continue
        try:
            values[key] = [unescape(raw)] if kind is list else kind(raw)
        except ValueError as error:
            raise UsageError(f"LLMCLI_{key.upper()} must be {kind.__name__}, got {raw!r}") from error
    return values
