"""Typed settings, their validation, and how the layers of defaults combine.

Precedence for sampling: what the user gave > the model's generation_config.json > built-in.
Only keys actually written in generation_config.json count: transformers' GenerationConfig
fills in its own defaults (top_k=50, temperature=1.0), which are not the model author's choice.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields, replace
from typing import TYPE_CHECKING, Any

from llmcli.errors import UsageError

if TYPE_CHECKING:
    from llmcli.config.user_config import UserConfig

# llama.cpp's defaults: a mild temperature, min-p to cut the junk tail, no repetition penalty.
BUILTIN_SAMPLING: dict[str, Any] = {
    "temperature": 0.8,
    "top_k": 40,
    "top_p": 0.95,
    "min_p": 0.05,
    "repetition_penalty": 1.0,
    "max_new_tokens": 512,
}

DEVICES = ("auto", "cpu", "cuda", "mps")
DTYPES = ("auto", "bf16", "fp16", "fp32")
QUANTS = ("auto", "none", "int8", "int4", "nf4", "fp4")
QUANT_TYPES = ("nf4", "fp4")
ENGINES = ("auto", "native", "transformers")


def setting_name(key: str, where: str = "flag") -> str:
    """A setting as the user wrote it: --top-p (a flag), LLMCLI_TOP_P (the environment), or
    top_p in a config file's section."""
    if where == "flag":
        return "--" + key.replace("_", "-")
    if where == "env":
        return f"LLMCLI_{key.upper()}"
    return f"{key} ({where})"


@dataclass(frozen=True)
class SamplingSettings:
    """What the user asked for; `None` means "not given, take the next layer's value"."""

    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    max_new_tokens: int | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()

    def validate(self, where: str = "flag") -> SamplingSettings:
        """Refuse impossible values before anything slow happens. `where` the values came from
        ("flag", "env", or a config file's "config PATH [section]") names them in the message."""
        checks = [
            ("temperature", lambda v: v >= 0, "≥ 0 (0 means greedy)"),
            ("top_k", lambda v: v >= 0, "≥ 0 (0 turns it off)"),
            ("top_p", lambda v: 0 < v <= 1, "in (0, 1] (1 turns it off)"),
            ("min_p", lambda v: 0 <= v <= 1, "in [0, 1] (0 turns it off)"),
            ("repetition_penalty", lambda v: v > 0, "> 0 (1 turns it off)"),
            ("max_new_tokens", lambda v: v >= 1, "≥ 1"),
            # torch seeds a generator with an unsigned 64-bit number.
            ("seed", lambda v: 0 <= v < 2**64, "in 0…18446744073709551615"),
        ]
        for key, ok, rule in checks:
            value = getattr(self, key)
            # value != value: NaN; value − value: inf (infinite values are no setting either)
            if value is not None and (value != value or value - value != 0 or not ok(value)):
                raise UsageError(f"{setting_name(key, where)} must be {rule}, got {value}")
        if any(s == "" for s in self.stop):
            raise UsageError(f"{setting_name('stop', where)} needs a non-empty string")
        return self

    def resolve(self, generation_config: dict[str, Any]) -> SamplingParams:
        """Fill every unset value from the model's generation_config.json, then the built-ins."""
        return self.resolve_with_sources(generation_config)[0]

    def resolve_with_sources(
        self, generation_config: dict[str, Any]
    ) -> tuple[SamplingParams, dict[str, str]]:
        """The resolved values, and for each value filled here, which layer it came from."""
        from_model = _sampling_from_generation_config(generation_config)
        values: dict[str, Any] = {}
        sources: dict[str, str] = {}
        for name in BUILTIN_SAMPLING:
            given = getattr(self, name)
            if given is not None:
                values[name] = given
            elif name in from_model:
                values[name], sources[name] = from_model[name], "generation_config.json"
            else:
                values[name], sources[name] = BUILTIN_SAMPLING[name], "built-in"
        return SamplingParams(**values, seed=self.seed, stop=self.stop), sources


@dataclass(frozen=True)
class SamplingParams:
    """Fully resolved sampling values, as the engine uses them."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    max_new_tokens: int = 512
    seed: int | None = None
    stop: tuple[str, ...] = field(default_factory=tuple)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def as_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def with_(self, **changes: Any) -> SamplingParams:
        return replace(self, **changes)


def _sampling_from_generation_config(config: dict[str, Any]) -> dict[str, Any]:
    """The sampling values a model's author wrote down, in our names."""
    picked = {name: config[name] for name in BUILTIN_SAMPLING if config.get(name) is not None}
    # An author who says do_sample=false means greedy, whatever temperature is also written.
    if config.get("do_sample") is False:
        picked["temperature"] = 0.0
    return picked


@dataclass(frozen=True)
class LoadSettings:
    device: str = "auto"
    dtype: str = "auto"
    threads: int | None = None
    trust_remote_code: bool = False
    allow_pickle: bool = False
    # auto (a GGUF's 4/8-bit weights stay int4/int8, else none), none, int8, int4 (native where it
    # runs, else bitsandbytes), nf4, fp4 (bitsandbytes)
    quant: str = "auto"
    quant_type: str = "nf4"  # for int4: nf4 or fp4
    double_quant: bool = True  # for int4: quantize the block scales too (~0.4 bits/weight saved)
    offload: bool = False  # let accelerate keep what does not fit on the GPU in CPU memory
    max_memory: int | None = None  # bytes llmcli may use on the device; default: all that is free
    context_length: int | None = None  # --ctx: at most this many tokens of context
    fast: bool | None = None  # graph-captured decode; None: on CUDA only (native), off (transformers)
    engine: str = "auto"  # native (llmcli's own forward), transformers, or auto: native where it runs

    def validate(self) -> LoadSettings:
        device_kind = self.device.split(":", 1)[0]
        if device_kind not in DEVICES:
            raise UsageError(f"--device must be one of {', '.join(DEVICES)} (or cuda:N), got {self.device!r}")
        if self.dtype not in DTYPES:
            raise UsageError(f"--dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.threads is not None and self.threads < 1:
            raise UsageError(f"--threads must be ≥ 1, got {self.threads}")
        if self.quant not in QUANTS:
            raise UsageError(f"--quant must be one of {', '.join(QUANTS)}, got {self.quant!r}")
        if self.quant_type not in QUANT_TYPES:
            raise UsageError(f"--quant-type must be one of {', '.join(QUANT_TYPES)}, got {self.quant_type!r}")
        if self.context_length is not None and self.context_length < 16:
            raise UsageError(f"--ctx must be at least 16 tokens, got {self.context_length}")
        if self.engine not in ENGINES:
            raise UsageError(f"--engine must be one of {', '.join(ENGINES)}, got {self.engine!r}")
        if self.offload and device_kind not in ("auto", "cuda"):
            raise UsageError("--offload spreads a model over GPU and CPU memory: it needs --device cuda")
        return self


SPECULATIVE_METHODS = ("off", "lookup", "draft")
MOST_DRAFT_TOKENS = 64
MOST_BEAMS = 64  # --num-beams: beam search keeps this many sequences at most


@dataclass(frozen=True)
class SpeculativeSettings:
    """Speculative decoding: off, lookup (drafts from the context's own n-grams), or draft (a
    smaller model with the same vocabulary; "self" is the model's own int4 copy)."""

    method: str = "off"
    draft_model: str | None = None
    draft_tokens: int | None = None  # None: as many as pay, measured as the reply goes

    @classmethod
    def from_values(cls, values: dict[str, Any]) -> SpeculativeSettings:
        draft_model = values.get("draft_model") or None
        # Naming a draft model is asking for one: --draft-model alone turns drafting on.
        method = values.get("speculative") or ("draft" if draft_model else "off")
        return cls(method=method, draft_model=draft_model, draft_tokens=values.get("draft_tokens")).validate()

    def validate(self) -> SpeculativeSettings:
        if self.method not in SPECULATIVE_METHODS:
            raise UsageError(
                f"--speculative must be one of {', '.join(SPECULATIVE_METHODS)}, got {self.method!r}"
            )
        if self.method == "draft" and not self.draft_model:
            raise UsageError(
                "--speculative draft needs a draft model",
                "add --draft-model MODEL (same tokenizer) or --draft-model self (the model's int4 copy)",
            )
        if self.draft_tokens is not None and not 1 <= self.draft_tokens <= MOST_DRAFT_TOKENS:
            raise UsageError(f"--draft-tokens must be in 1…{MOST_DRAFT_TOKENS}, got {self.draft_tokens}")
        return self


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


def effective_settings(
    model_flag: str | None, flags: dict[str, Any], user_config: UserConfig | None = None
) -> Effective:
    """flag > environment > the model's config section > config [defaults] (the model's
    generation_config.json and the built-ins come after, when the model is loaded)."""
    from llmcli.config.user_config import env_settings, load_user_config

    config = user_config or load_user_config()
    env_model = os.environ.get("LLMCLI_MODEL") or None
    candidates = [
        (model_flag, "flag -m"),
        (env_model, "env LLMCLI_MODEL"),
        (config.model, f"config {config.path}"),
    ]
    model, model_source = next(((m, source) for m, source in candidates if m), (None, "built-in default"))
    model = config.expand(model)
    layers = [
        ("flag", {k: v for k, v in flags.items() if v is not None and v != ()}),
        ("env", env_settings()),
        (f'config [models."{model}"]', config.for_model(model) if model else {}),
        ("config [defaults]", config.defaults),
    ]
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for name, layer in layers:
        given = {key: layer[key] for key in (*BUILTIN_SAMPLING, "seed") if key in layer}
        where = name if name in ("flag", "env") else f"{name} of {config.path}"
        SamplingSettings(**given, stop=tuple(layer.get("stop") or ())).validate(where)
    for name, layer in layers:
        for key, value in layer.items():
            if key not in values:
                values[key], sources[key] = value, name
    sampling = SamplingSettings(
        **{key: values.get(key) for key in (*BUILTIN_SAMPLING, "seed")},
        stop=tuple(values.get("stop") or ()),
    ).validate()
    return Effective(
        model=model,
        model_source=model_source,
        sampling=sampling,
        system=values.get("system"),
        context_length=values.get("ctx"),
        engine=values.get("engine"),
        sources=sources,
        speculative=SpeculativeSettings.from_values(values),
    )
