"""Command-line options made from the settings' declarations (config/declare.py).

A command names the settings it takes as parameters typed with a settings class:

    @app.command()
    @with_settings
    def generate(prompt: …, sampling: SamplingSettings, load: LoadSettings) -> None: …

`with_settings` replaces each such parameter with one option per declared field (its flags,
help, panel and default), and when the command runs, builds the settings object from them.
`Only(...)` in the annotation takes a subset (`bench` declares the loading flags it uses).
Adding a setting is adding a field: every command that takes its group gets the flag.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import typing
from collections.abc import Callable
from typing import Annotated, Any, get_args, get_origin

import typer

from llmcli.cli.support import handled_errors
from llmcli.config.declare import Declared, completions_of, declarations, flag_of
from llmcli.config.escapes import unescape
from llmcli.errors import UsageError


@dataclasses.dataclass(frozen=True)
class Only:
    """In an annotation: take these fields of the settings group only."""

    names: tuple[str, ...]

    def __init__(self, *names: str) -> None:
        object.__setattr__(self, "names", names)


def with_settings(command: Callable[..., Any]) -> Callable[..., Any]:
    signature = inspect.signature(command, eval_str=True)
    kept: list[inspect.Parameter] = []
    groups: dict[str, tuple[type, list[str]]] = {}
    for parameter in signature.parameters.values():
        settings_class, names = _settings_group(parameter.annotation)
        if settings_class is None:  # keyword-only, as the generated ones: typer passes names
            kept.append(parameter.replace(kind=inspect.Parameter.KEYWORD_ONLY))
            continue
        groups[parameter.name] = (settings_class, names)
        declared = declarations(settings_class)
        kept += [_option(f"{parameter.name}__{name}", name, declared[name], settings_class) for name in names]

    @functools.wraps(command)
    def run(**given: Any) -> Any:
        with handled_errors():  # a value refused here is one line, as anywhere in the command
            return _call(command, groups, given)

    run.__signature__ = signature.replace(parameters=kept)  # type: ignore[attr-defined]
    return run


def _call(
    command: Callable[..., Any], groups: dict[str, tuple[type, list[str]]], given: dict[str, Any]
) -> Any:
    for group, (settings_class, names) in groups.items():
        declared = declarations(settings_class)
        fields = {f.name: f for f in dataclasses.fields(settings_class)}
        values = {
            name: _converted(given.pop(f"{group}__{name}"), name, declared[name], fields[name])
            for name in names
        }
        given[group] = settings_class(**values)
    return command(**given)


def _settings_group(annotation: Any) -> tuple[type | None, list[str]]:
    only: tuple[str, ...] | None = None
    if get_origin(annotation) is Annotated:
        annotation, *extras = get_args(annotation)
        only = next((extra.names for extra in extras if isinstance(extra, Only)), None)
    if not (isinstance(annotation, type) and dataclasses.is_dataclass(annotation)):
        return None, []
    declared = declarations(annotation)
    if not declared:
        return None, []
    return annotation, list(only or declared)


def _option(parameter: str, name: str, declared: Declared, settings_class: type) -> inspect.Parameter:
    field = next(f for f in dataclasses.fields(settings_class) if f.name == name)
    default = field.default if declared.cli_default == "field" else declared.cli_default
    # What the flag reads: the field's own type (float | None), unless the declaration says.
    kind = declared.cli_type or typing.get_type_hints(settings_class)[name]
    flags = declared.flags or ("--" + name.replace("_", "-"),)
    if flags[0].startswith("--") and "/" not in flags[0] and kind is bool and default is True:
        flags = (f"{flags[0]}/--no-{flags[0][2:]}",)
    values = completions_of(declared)
    option = typer.Option(
        *flags,
        help=declared.help,
        rich_help_panel=declared.panel,
        show_default=declared.show_default if default is not None else False,
        envvar=declared.envvar,
        autocompletion=(lambda incomplete: [v for v in values if v.startswith(incomplete)])
        if values
        else None,
    )
    return inspect.Parameter(
        parameter, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=Annotated[kind, option]
    )


def _converted(value: Any, name: str, declared: Declared, field: dataclasses.Field[Any]) -> Any:
    """A flag's value as its field holds it. A layered setting not given stays None (the
    environment and config file come next); any other takes its field's default."""
    if value is None:
        return None if declared.layered and not isinstance(field.default, tuple) else field.default
    if isinstance(value, list):  # --stop, repeatable: escapes read (unless it reads its own), as a tuple
        return tuple((declared.parse or unescape)(text) for text in value)
    if declared.parse is not None:
        try:
            return declared.parse(value)
        except ValueError as error:
            raise UsageError(f"{flag_of(name, declared)}: {error}") from error
    return value
