"""config.json as the native engine reads it, without transformers' configuration classes: the
values it names, and transformers' defaults for the fields it leaves out (the Llama family's,
and where its family's row in families.py says otherwise).

Also the RoPE frequencies, computed as transformers computes them for the RoPE types the lean
path takes (default, linear, llama3, longrope, yarn); others are refused (`LeanUnsupported`) and
the loader takes transformers' path, which settles them.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from llmcli.errors import LlmcliError
from llmcli.models.families import Family, family

# What transformers' Llama, Mistral and Qwen2/3 configurations fill in where config.json is silent.
DEFAULTS: dict[str, Any] = {
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "mlp_bias": False,
    "head_dim": None,
    "num_key_value_heads": None,
    "sliding_window": None,
    "layer_types": None,
    "rope_scaling": None,
    "rope_parameters": None,
    "partial_rotary_factor": 1.0,
    "max_position_embeddings": 2048,
    "bos_token_id": None,
    "eos_token_id": None,
    "pad_token_id": None,
}
LEAN_ROPE_TYPES = frozenset({"default", "linear", "llama3", "longrope", "yarn", "proportional"})


class LeanUnsupported(LlmcliError):
    """What the lean load path cannot read (the message names it); transformers' path can."""


class TokenizerUnsupported(LeanUnsupported):
    """A tokenizer the lean tokenizer does not read as it stands (transformers builds it in code):
    kept once transformers has built it (tokenizer_capture.py)."""


class DamagedCheckpoint(LeanUnsupported):
    """A checkpoint that does not match its config (a tensor missing): transformers' path refuses
    it in one line naming the tensor, so the lean path leaves it to that refusal, without a note."""


class LeanConfig:
    """config.json's values as attributes (`getattr(config, name, default)` works as on
    transformers' configs), with the family defaults above."""

    def __init__(self, values: dict[str, Any]) -> None:
        row = family((values.get("architectures") or [""])[0])
        if row is not None and row.language_model is not None:
            values = text_part(values)
        defaults = row.config_defaults if row is not None else {}
        self._values = {**DEFAULTS, **defaults, **values}
        if self._values.get("num_key_value_heads") is None:
            self._values["num_key_value_heads"] = self._values.get("num_attention_heads")
        if row is None:
            return
        if row.layer_types == "gemma3":
            self._gemma3()
        elif row.layer_types == "gemma4":
            from llmcli.models.gemma4_layout import settle

            if self._values.get("use_bidirectional_attention") == "all":  # "vision": text stays causal
                raise LeanUnsupported("bidirectional attention over all tokens")
            settle(self._values)
        elif row.layer_types == "linear" and self._values.get("layer_types") is None:
            interval = self._values.get("full_attention_interval", 4)  # Qwen3_5TextConfig's
            layers = range(self._values["num_hidden_layers"])
            self._values["layer_types"] = [
                "full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in layers
            ]
        elif row.layer_types == "alternating" and self._values.get("layer_types") is None:
            layers = range(self._values["num_hidden_layers"])  # sliding and global in turn
            self._values["layer_types"] = ["full_attention" if i % 2 else "sliding_attention" for i in layers]
        rope_given = values.get("rope_parameters") or values.get("rope_scaling")
        if row.default_rope is not None and not rope_given:
            self._values["rope_parameters"] = dict(row.default_rope)

    @property
    def family(self) -> Family | None:
        """Its architecture's row in the families table (families.py)."""
        return family((self._values.get("architectures") or [""])[0])

    def _gemma3(self) -> None:
        """Gemma 3's layer kinds and a RoPE table for each, as Gemma3TextConfig settles them from
        a config.json of any age (`sliding_window_pattern`, `rope_local_base_freq`, a global
        `rope_scaling`)."""
        values = self._values
        if values.get("use_bidirectional_attention"):
            raise LeanUnsupported("bidirectional attention (an embedding model)")
        if values.get("layer_types") is None:
            pattern = values["sliding_window_pattern"]
            values["layer_types"] = [
                "sliding_attention" if (i + 1) % pattern else "full_attention"
                for i in range(values["num_hidden_layers"])
            ]
        ropes = values.get("rope_parameters")
        if ropes is not None and not {"full_attention", "sliding_attention"} & set(ropes):
            raise LeanUnsupported("Gemma 3 RoPE parameters not given per kind of layer")
        ropes = {kind: dict(rope) for kind, rope in (ropes or {}).items() if isinstance(rope, dict)}
        full = ropes.setdefault("full_attention", {"rope_type": "default"})
        full.update(values.get("rope_scaling") or {})
        full.setdefault("rope_theta", values.get("rope_theta", 1_000_000.0))
        local = ropes.setdefault("sliding_attention", {"rope_type": "default"})
        local.setdefault("rope_theta", values.get("rope_local_base_freq", 10_000.0))
        for rope in ropes.values():
            rope["rope_type"] = rope.get("rope_type", rope.get("type", "default"))
        values["rope_parameters"] = ropes

    def for_kind(self, kind: str | None) -> LeanConfig:
        """This config as one kind of its layers reads it: Gemma 4's full layers have their own
        head width and KV heads (gemma4_layout.py), which their RoPE table is computed over."""
        row = self.family
        if kind is None or row is None or row.layer_types != "gemma4":
            return self
        from llmcli.models.gemma4_layout import kind_shape

        head_dim, kv_heads = kind_shape(self, kind)
        view = LeanConfig.__new__(LeanConfig)
        view._values = {**self._values, "head_dim": head_dim, "num_key_value_heads": kv_heads}
        return view

    def __getattr__(self, name: str) -> Any:
        values = self.__dict__.get("_values", {})
        if name in values:
            return values[name]
        raise AttributeError(name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "_values":
            object.__setattr__(self, name, value)
        else:
            self._values[name] = value

    def get_text_config(self) -> LeanConfig:
        return self

    def to_dict(self) -> dict[str, Any]:
        return dict(self._values)

    @property
    def rope(self) -> dict[str, Any]:
        """The RoPE parameters wherever this config writes them (transformers 5's
        `rope_parameters`, older `rope_scaling` plus `rope_theta`)."""
        found = self._values.get("rope_parameters") or self._values.get("rope_scaling") or {}
        rope = dict(found) if isinstance(found, dict) else {}
        rope.setdefault("rope_theta", self._values.get("rope_theta", 10000.0))
        rope["rope_type"] = rope.get("rope_type", rope.get("type", "default"))
        row = self.family
        if rope["rope_type"] in ("su", "yarn") and row is not None and row.longrope_aliases:
            rope["rope_type"] = "longrope"  # Phi-3's older names for it, as transformers reads them
        if rope["rope_type"] == "mrope":  # Qwen2-VL's older name: plain RoPE on each of 3 axes
            rope["rope_type"] = "default"
        return rope


def text_part(values: dict[str, Any]) -> dict[str, Any]:
    """A vision-language checkpoint's config as its language model's: config.json's `text_config`,
    under the checkpoint's architecture, with what the outer config says of the whole (a tied
    head, the special ids). transformers ties the head by the whole's config."""
    outer = ("architectures", "tie_word_embeddings", "bos_token_id", "eos_token_id", "pad_token_id")
    # Qwen2.5-VL's released config.json writes its language model's fields at the top.
    text = values.get("text_config") or values
    return {**text, **{key: values[key] for key in outer if key in values}}


def rope_frequencies(config: LeanConfig, rope: dict[str, Any] | None = None) -> tuple[torch.Tensor, float]:
    """(inv_freq [head_dim / 2], attention scaling) as transformers' rotary embedding holds them
    (`rope`: one kind of layer's parameters, Gemma 3's; the config's own by default)."""
    rope = rope if rope is not None else config.rope
    kind = rope["rope_type"]
    if kind not in LEAN_ROPE_TYPES:
        raise LeanUnsupported(f"its RoPE type {kind!r}")
    if kind == "longrope":  # the table transformers builds: the short factors (phi3.py picks)
        return longrope_frequencies(config, length=None)
    if kind == "yarn":
        return _yarn(config, rope)
    if kind == "proportional":
        return _proportional(config, rope), 1.0
    inv_freq = 1.0 / (float(rope["rope_theta"]) ** _exponents(config, rope))
    if kind == "linear":
        inv_freq = inv_freq / float(rope["factor"])
    elif kind == "llama3":
        inv_freq = _llama3(inv_freq, rope)
    return inv_freq, 1.0


def _rotated_width(config: Any, rope: dict[str, Any]) -> int:
    """d, the rotated dimensions of a head: its width times the partial rotary factor, which
    transformers 5 keeps among the RoPE parameters (Phi-4-mini rotates 3/4 of each head)."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    partial = rope.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", None) or 1.0)
    return int(head_dim * float(partial))


def _exponents(config: Any, rope: dict[str, Any]) -> torch.Tensor:
    """2i / d for each rotated pair of a head's d rotated dimensions, as transformers computes them."""
    dim = _rotated_width(config, rope)
    return torch.arange(0, dim, 2, dtype=torch.int64).float() / dim


def _proportional(config: Any, rope: dict[str, Any]) -> torch.Tensor:
    """Gemma 4's full layers: the first `partial_rotary_factor` of each half of the head turned at
    the frequencies a whole head's first pairs would have (exponents over the whole width), the
    rest at frequency 0 (cos 1, sin 0: passed unrotated), as transformers computes it."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    angles = int(float(rope.get("partial_rotary_factor", 1.0)) * head_dim // 2)
    exponents = torch.arange(0, 2 * angles, 2, dtype=torch.int64).float() / head_dim
    rotated = 1.0 / (float(rope["rope_theta"]) ** exponents)
    inv_freq = torch.cat((rotated, torch.zeros(head_dim // 2 - angles)))
    return inv_freq / float(rope.get("factor", 1.0))


def _yarn(config: Any, rope: dict[str, Any]) -> tuple[torch.Tensor, float]:
    """YaRN (gpt-oss, Qwen's long-context configs) as transformers computes it: the frequencies
    that turn fewer than `beta_slow` times over the pretraining length divided by the factor, those
    turning more than `beta_fast` times kept, a linear ramp between; cos and sin scaled by the
    attention factor."""
    base, dim = float(rope["rope_theta"]), _rotated_width(config, rope)
    original, factor = _pretraining_length_and_factor(config, rope)
    attention = rope.get("attention_factor")
    if attention is None:
        mscale, mscale_all_dim = rope.get("mscale"), rope.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
        else:
            attention = _yarn_mscale(factor)

    def correction_dim(rotations: float) -> float:  # the dimension turning `rotations` times
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(rope.get("beta_fast") or 32), correction_dim(rope.get("beta_slow") or 1)
    if rope.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as transformers avoids the division by zero
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    kept = 1 - ramp  # the share of each frequency left unscaled
    powers = base ** _exponents(config, rope)
    inv_freq = (1.0 / (factor * powers)) * (1 - kept) + (1.0 / powers) * kept
    return inv_freq, float(attention)


def _pretraining_length_and_factor(config: Any, rope: dict[str, Any]) -> tuple[float, float]:
    """The pretraining length and the scaling factor of a long-context RoPE (yarn, longrope), as
    transformers settles them: a length beside the RoPE parameters (Phi-3 keeps one) comes first,
    and a factor left out is the context over that length."""
    original = (
        getattr(config, "original_max_position_embeddings", None)
        or rope.get("original_max_position_embeddings")
        or config.max_position_embeddings
    )
    return original, rope.get("factor") or config.max_position_embeddings / original


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def longrope_frequencies(config: Any, length: int | None) -> tuple[torch.Tensor, float]:
    """LongRoPE's (inv_freq, attention scaling) as transformers computes them for a text of
    `length` (Phi-3.5, Phi-4-mini): the long factors past the pretraining length, the short ones
    within it (and for None). `config`: a LeanConfig or transformers' own configuration."""
    rope = config.rope if isinstance(config, LeanConfig) else dict(config.rope_parameters)
    original, factor = _pretraining_length_and_factor(config, rope)
    attention = rope.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    factors = rope["long_factor"] if length and length > original else rope["short_factor"]
    exponents = _exponents(config, rope)
    inv_freq = 1.0 / (torch.tensor(factors, dtype=torch.float32) * float(rope["rope_theta"]) ** exponents)
    return inv_freq, float(attention)


def _llama3(inv_freq: torch.Tensor, rope: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1's scaling: long wavelengths divided by the factor, short ones kept, those
    between blended smoothly."""
    factor = float(rope["factor"])
    low, high = float(rope["low_freq_factor"]), float(rope["high_freq_factor"])
    original = float(rope["original_max_position_embeddings"])
    low_wavelen, high_wavelen = original / low, original / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (original / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)
