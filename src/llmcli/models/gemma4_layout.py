"""Gemma 4's layer layout as Gemma4TextConfig settles it, torch-free: each layer's kind, its head
width and KV heads, the layer whose keys and values it attends over (KV sharing), and the tensors
its checkpoint must hold. The loader's checks (build_native), the lean model (lean_model) and the
engine family (engine/native/families/gemma4.py) all read the layout from here.

config.json names a layer's head width and KV heads either per layer (`per_layer_config`, as
transformers writes a config it saved) or per kind (`global_head_dim` and
`num_global_key_value_heads` for the full layers, as the published checkpoints do); the sliding
layers take the config's own `head_dim` and `num_key_value_heads`.
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping
from typing import Any

from llmcli.errors import ModelLoadError

SLIDING, FULL = "sliding_attention", "full_attention"
# What Gemma4TextConfig fills in where config.json is silent (it pops these rather than keeping
# them, so the families table's test cannot compare them as attributes).
GLOBAL_HEAD_DIM = 512
SLIDING_WINDOW_PATTERN = 6  # every sixth layer full, the rest sliding
DEFAULT_ROPE: dict[str, dict[str, Any]] = {
    SLIDING: {"rope_type": "default", "rope_theta": 10_000.0},
    FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0},
}


class BadLayout(ModelLoadError):
    """A config.json whose layers cannot be laid out as it says (a setting named in one line)."""


def settle(values: MutableMapping[str, Any]) -> None:
    """Fill in the layer kinds and RoPE per kind as Gemma4TextConfig does (the last layer forced
    to full attention), in `values` (config.json's, over the family's defaults)."""
    layers = values["num_hidden_layers"]
    kinds = values.get("layer_types")
    if kinds is None:
        kinds = [SLIDING if (i + 1) % SLIDING_WINDOW_PATTERN else FULL for i in range(layers)]
    kinds = list(kinds)
    if kinds:
        kinds[-1] = FULL
    values["layer_types"] = kinds
    ropes = values.get("rope_parameters") or {}
    values["rope_parameters"] = {
        kind: dict(ropes.get(kind) or DEFAULT_ROPE[kind]) for kind in sorted(set(kinds))
    }


def layer_shapes(config: Any) -> list[tuple[int, int]]:
    """(head width, KV heads) of each layer, as Gemma4TextConfig's `per_layer_config` gives them."""
    kinds = config.layer_types
    given: Mapping[str, Mapping[str, Any]] | None = getattr(config, "per_layer_config", None)
    shapes = []
    for index, kind in enumerate(kinds):
        head_dim, kv_heads = config.head_dim, config.num_key_value_heads
        if given is not None:
            override = given.get(str(index)) or given.get(index) or {}  # type: ignore[call-overload]
        elif kind == FULL:
            override = {"head_dim": getattr(config, "global_head_dim", None) or GLOBAL_HEAD_DIM}
            global_kv = getattr(config, "num_global_key_value_heads", None)
            if global_kv is not None and getattr(config, "attention_k_eq_v", False):
                override["num_key_value_heads"] = global_kv
        else:
            override = {}
        shapes.append((override.get("head_dim", head_dim), override.get("num_key_value_heads", kv_heads)))
    return shapes


def kind_shape(config: Any, kind: str) -> tuple[int, int]:
    """(head width, KV heads) of the first layer of `kind` (every layer of a kind has the same)."""
    return layer_shapes(config)[list(config.layer_types).index(kind)]


def kv_sources(config: Any) -> list[int]:
    """The layer whose keys and values each layer attends over: its own, or for the last
    `num_kv_shared_layers`, the last layer of its kind before them (Gemma4TextConfig's
    `kv_sharing_modes`). BadLayout where such a layer's kind has no layer before them: its keys
    would have to come from a later layer, or from none."""
    kinds = list(config.layer_types)
    shared = int(getattr(config, "num_kv_shared_layers", 0) or 0)
    first_reader = len(kinds) - shared
    if shared < 0 or first_reader < 0:
        raise BadLayout(f"config.json's num_kv_shared_layers {shared} is not between 0 and {len(kinds)}")
    sources = list(range(len(kinds)))
    for index in range(first_reader, len(kinds)):
        producers = [i for i in range(first_reader) if kinds[i] == kinds[index]]
        if not producers:
            raise BadLayout(
                f"config.json's num_kv_shared_layers {shared} has layer {index} ({kinds[index]}) read "
                f"the keys and values of a later layer: no {kinds[index]} layer before layer "
                f"{first_reader} computes them",
                "the config does not match a Gemma 4 checkpoint: download it again",
            )
        sources[index] = producers[-1]
    return sources


def expected_tensors(config: Any, prefix: str = "model") -> list[str]:
    """The tensors a Gemma 4 text checkpoint must hold for this config, by transformers' names (a
    reading layer has no keys, values or their norms; the head is tied or `lm_head.weight`)."""
    sources = kv_sources(config)
    names = [f"{prefix}.embed_tokens.weight", f"{prefix}.norm.weight"]
    if getattr(config, "hidden_size_per_layer_input", None):
        names += [
            f"{prefix}.embed_tokens_per_layer.weight",
            f"{prefix}.per_layer_model_projection.weight",
            f"{prefix}.per_layer_projection_norm.weight",
        ]
    for index, kind in enumerate(config.layer_types):
        names += [f"{prefix}.layers.{index}.{name}" for name in layer_tensors(config, index, kind, sources)]
    if not config.tie_word_embeddings:
        names.append("lm_head.weight")
    return names


def layer_tensors(config: Any, index: int, kind: str, sources: list[int]) -> list[str]:
    """One layer's tensor names, under its own prefix."""
    names = [
        f"{norm}.weight"
        for norm in (
            "input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
            "post_feedforward_layernorm",
        )
    ]  # fmt: skip
    names += ["layer_scalar", "self_attn.q_proj.weight", "self_attn.q_norm.weight", "self_attn.o_proj.weight"]
    if sources[index] == index:
        names += ["self_attn.k_proj.weight", "self_attn.k_norm.weight"]
        if not keys_are_values(config, kind):
            names.append("self_attn.v_proj.weight")
    names += [f"mlp.{name}.weight" for name in ("gate_proj", "up_proj", "down_proj")]
    if getattr(config, "hidden_size_per_layer_input", None):
        names += [
            "per_layer_input_gate.weight",
            "per_layer_projection.weight",
            "post_per_layer_input_norm.weight",
        ]
    if getattr(config, "enable_moe_block", False):
        names += [
            "router.proj.weight", "router.scale", "router.per_expert_scale", "experts.gate_up_proj",
            "experts.down_proj", "post_feedforward_layernorm_1.weight", "post_feedforward_layernorm_2.weight",
            "pre_feedforward_layernorm_2.weight",
        ]  # fmt: skip
    return names


def keys_are_values(config: Any, kind: str) -> bool:
    """`attention_k_eq_v`: a full layer's values are its keys' projection (no v_proj)."""
    return bool(getattr(config, "attention_k_eq_v", False)) and kind != SLIDING


def check_checkpoint(config: Any, shapes: Mapping[str, Any], where: Any, prefix: str = "model") -> None:
    """A layout that cannot be (BadLayout), or a tensor the config implies that `shapes` (the
    checkpoint's, by name: no weight read) lacks, named in one line (ModelLoadError). `prefix`:
    where the language model's tensors lie."""
    missing = next((name for name in expected_tensors(config, prefix) if name not in shapes), None)
    if missing is not None:
        raise ModelLoadError(
            f"{where} lacks the tensor {missing} that its config.json implies",
            "the checkpoint is incomplete or not for this config: download it again",
        )
