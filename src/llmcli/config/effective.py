"""The settings a command runs with: flag > environment > the model's config section > config
[defaults] or top level, each value with where it came from. Apart from settings.py, which
declares the groups, because the config file's checks (user_config.py) need those declarations
and this needs the config file: settings → user_config → here would otherwise be a circle."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from llmcli.config.settings import (
    SAMPLING_NUMBERS,
    LoadSettings,
    PromptSettings,
    SamplingSettings,
    SpeculativeSettings,
    keep_alive_seconds,
    prompt_cache_bytes,
)
from llmcli.config.user_config import UserConfig, env_settings, load_user_config


@dataclass(frozen=True)
class Effective:
    """What a command runs with once every layer is applied, and where each value came from."""

    model: str | None  # None: the built-in default model
    model_source: str
    sampling: SamplingSettings
    system: str | None
    context_length: int | None
    engine: str | None
    sources: dict[str, str]
    speculative: SpeculativeSettings = field(default_factory=SpeculativeSettings)
    load: LoadSettings = field(default_factory=LoadSettings)
    think: str | None = None  # show, hide, off; None: the front end's choice (terminal or pipe)
    think_budget: int | None = None
    keep_alive_s: float | None = None  # a server of this model stays this long after an in-process call
    keep_alive: str | None = None  # the same, as written (`config show` prints it so)


def effective_settings(
    model_flag: str | None,
    flags: dict[str, Any],
    user_config: UserConfig | None = None,
    *,
    load: LoadSettings | None = None,
    expand: Callable[[str], str] | None = None,
    names: Callable[[str | None], list[str]] | None = None,
) -> Effective:
    """flag > environment > the model's config section > config [defaults] or top level (the model's
    generation_config.json and the built-ins come after, when the model is loaded). `expand`
    turns a built-in alias into what it names, and `names` lists every name a model goes by
    (None: the default model), which the model's section may use (the model layer knows them,
    not this one)."""
    config = user_config or load_user_config()
    env_model = os.environ.get("LLMCLI_MODEL") or None
    candidates = [
        (model_flag, "flag -m"),
        (env_model, "env LLMCLI_MODEL"),
        (config.model, f"config {config.path}"),
    ]
    model, model_source = next(((m, source) for m, source in candidates if m), (None, "built-in default"))
    typed = model
    model = config.expand(model, expand)
    known_as = names(model) if names else ([model] if model else [])
    section = config.section_for([*known_as, *([typed] if typed else [])])
    layers = [
        ("flag", {k: v for k, v in flags.items() if v is not None and v != ()}),
        ("env", env_settings()),
        (f'config [models."{section}"]', config.for_model(section) if section else {}),
        ("config [defaults]", config.defaults),
        ("config top level", config.top_level),  # never the same key as [defaults]
    ]
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for name, layer in layers:
        given = {key: layer[key] for key in SAMPLING_NUMBERS if key in layer}
        where = name if name in ("flag", "env") else f"{name} of {config.path}"
        SamplingSettings(**given, stop=tuple(layer.get("stop") or ())).validate(where)
        PromptSettings(think=layer.get("think"), think_budget=layer.get("think_budget")).validate(where)
        keep_alive_seconds(layer.get("keep_alive"), where)
        if layer.get("prompt_cache_size") is not None:
            prompt_cache_bytes(str(layer["prompt_cache_size"]), where)
    for name, layer in layers:
        for key, value in layer.items():
            if key not in values:
                values[key], sources[key] = value, name
    sampling = SamplingSettings(
        **{key: values.get(key) for key in SAMPLING_NUMBERS},
        stop=tuple(values.get("stop") or ()),
    ).validate()
    cache_size = values.get("prompt_cache_size")
    load = replace(
        load or LoadSettings(),
        context_length=values.get("ctx"),
        engine=values.get("engine") or "auto",
        prompt_cache_size=None if cache_size is None else str(cache_size),
    )
    return Effective(
        model=model,
        model_source=model_source,
        sampling=sampling,
        system=values.get("system"),
        context_length=values.get("ctx"),
        engine=values.get("engine"),
        sources=sources,
        speculative=SpeculativeSettings.from_values(values),
        load=load.validate(),
        think=values.get("think"),
        think_budget=values.get("think_budget"),
        keep_alive_s=keep_alive_seconds(values.get("keep_alive"), sources.get("keep_alive", "flag")),
        keep_alive=values.get("keep_alive"),
    )
