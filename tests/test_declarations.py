"""Each setting is declared once, on its settings dataclass: the commands' flags, the config
file's and the environment's keys, and the server's request fields all come from there."""

from __future__ import annotations

import dataclasses
from typing import Annotated

import pydantic
import pytest
import typer

from llmcli.cli.app import BENCH_LOADING, app
from llmcli.cli.options import with_settings
from llmcli.config.declare import Bounds, declarations, flag_of, setting
from llmcli.config.settings import (
    SAMPLING_NUMBERS,
    LoadSettings,
    OutputSettings,
    PromptSettings,
    RemoteSettings,
    SamplingSettings,
    SpeculativeSettings,
)
from llmcli.config.user_config import setting_types
from llmcli.server.client import OPENAI_NAMES
from llmcli.server.protocol import ChatRequest


def flags_of(command: str) -> set[str]:
    click_command = typer.main.get_command(app).commands[command]
    return {option for param in click_command.params for option in param.opts}


def declared_flags(*groups: type, only: tuple[str, ...] | None = None) -> set[str]:
    return {
        flag_of(name, declared)
        for group in groups
        for name, declared in declarations(group).items()
        if only is None or name in only
    }


def test_every_command_has_the_flags_of_the_groups_it_takes() -> None:
    everything = (SamplingSettings, PromptSettings, LoadSettings, SpeculativeSettings, OutputSettings)
    assert declared_flags(*everything, RemoteSettings) <= flags_of("generate")
    assert declared_flags(*everything, RemoteSettings) <= flags_of("chat")
    assert declared_flags(LoadSettings, SpeculativeSettings) <= flags_of("serve")
    bench = flags_of("bench")
    assert (
        declared_flags(LoadSettings, only=BENCH_LOADING.names) | declared_flags(SpeculativeSettings) <= bench
    )
    # bench takes the loading flags it declares, and no others
    assert not (declared_flags(LoadSettings) - declared_flags(LoadSettings, only=BENCH_LOADING.names)) & bench
    assert not declared_flags(SamplingSettings) & (bench | flags_of("serve"))


@dataclasses.dataclass(frozen=True)
class Extra:
    presence_penalty: float | None = setting(
        help="Penalise tokens seen.", panel="Sampling", bounds=Bounds(ge=-2, le=2)
    )


def test_a_new_field_is_a_new_flag_with_its_bounds() -> None:
    """What adding a setting costs: one field. It becomes a flag with its help and default,
    its value reaches the command inside the settings object, and its bounds are checked."""

    seen: list[Extra] = []
    test_app = typer.Typer()

    @test_app.command()
    @with_settings
    def run(*, name: Annotated[str, typer.Option()] = "x", extra: Extra) -> None:
        from llmcli.config.declare import check_bounds

        check_bounds(extra)
        seen.append(extra)

    command = typer.main.get_command(test_app)
    command.main(["--presence-penalty", "0.5"], standalone_mode=False)
    command.main([], standalone_mode=False)
    assert seen == [Extra(presence_penalty=0.5), Extra(presence_penalty=None)]
    assert command.main(["--presence-penalty", "3"], standalone_mode=False) == 2  # a usage error
    assert len(seen) == 2


def test_the_environment_and_the_config_file_take_the_layered_settings() -> None:
    layered = {
        declared.key or name
        for group in (SamplingSettings, PromptSettings, LoadSettings, SpeculativeSettings, RemoteSettings)
        for name, declared in declarations(group).items()
        if declared.layered
    }
    assert set(setting_types()) == layered
    wanted = {"temperature", "stop", "system", "ctx", "engine", "speculative", "draft_tokens", "keep_alive"}
    assert wanted <= layered
    assert "device" not in layered  # flags only: a config file does not move a model to a GPU


@pytest.mark.parametrize("name", SAMPLING_NUMBERS)
def test_the_server_refuses_what_the_flag_refuses(name: str) -> None:
    bounds = declarations(SamplingSettings)[name].bounds
    assert bounds is not None
    field = OPENAI_NAMES.get(name, name)
    messages = [{"role": "user", "content": "hi"}]
    for edge in (bounds.ge, bounds.le):
        if edge is not None:
            ChatRequest(messages=messages, **{field: edge})  # a bound that includes its edge
    outside = [v for v in (
        None if bounds.ge is None else bounds.ge - 1,
        bounds.gt,
        None if bounds.le is None else bounds.le + 1,
        bounds.lt,
    ) if v is not None]  # fmt: skip
    assert outside
    for value in outside:
        with pytest.raises(pydantic.ValidationError, match=field):
            ChatRequest(messages=messages, **{field: value})
        with pytest.raises(Exception, match="must be"):
            SamplingSettings(**{name: value}).validate()
