"""Gemma 4's GGUF files (llama.cpp's `gemma4`) as llama.cpp's converter writes them, read back
into transformers' names and a Gemma4TextConfig, so that the lean model reads them as a folder's.

The converter (Gemma4Model in convert_hf_to_gguf.py) stores the tensors as they are (its norms
are not plus one, unlike Gemma 3's) under gguf's Gemma 4 names, and gives the layout per layer
in the metadata rather than per kind:

- `attention.sliding_window_pattern`: one bool per layer, true for a sliding one;
- `attention.key_length` the full layers' head width, `attention.key_length_swa` the sliding
  ones'; `attention.head_count_kv` and `feed_forward_length` a number or one per layer (the
  latter doubled on the KV-shared layers of a double-wide MLP);
- `attention.shared_kv_layers`: how many layers at the end read another's keys and values;
- the full layers' proportional RoPE as the tensor `rope_freqs`: 1 on each rotated pair, 1e30
  (never turning) on the others. It is no Llama 3.1 scaling, and is read here as the rotated
  share it encodes.

A full layer without `attn_v` takes its values from its keys (`attention_k_eq_v`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from llmcli.models import gguf_deltanet

# The tensors named as in Qwen3.5's files (its attention's, its dense MLP's), within a block.
_AS_QWEN35 = (
    "attn_norm.weight", "post_attention_norm.weight", "attn_q.weight", "attn_k.weight", "attn_v.weight",
    "attn_output.weight", "attn_q_norm.weight", "attn_k_norm.weight", "ffn_gate.weight", "ffn_up.weight",
    "ffn_down.weight",
)  # fmt: skip
# A block's tensors, by their name in the file (within `blk.N.`) → transformers' (within
# `model.layers.N.`): gguf's own Gemma 4 tensor map, inverted.
BLOCK_NAMES = {
    **{name: gguf_deltanet.BLOCK_NAMES[name] for name in _AS_QWEN35},
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
    "inp_gate.weight": "per_layer_input_gate.weight",
    "proj.weight": "per_layer_projection.weight",
    "post_norm.weight": "post_per_layer_input_norm.weight",
    "layer_output_scale.weight": "layer_scalar",
    # The MoE's experts beside the dense MLP, its router and its own norms (26B-A4B).
    "ffn_gate_inp.weight": "router.proj.weight",
    "ffn_gate_inp.scale": "router.scale",
    "ffn_gate_up_exps.weight": "experts.gate_up_proj",
    "ffn_down_exps.weight": "experts.down_proj",
    "ffn_down_exps.scale": "router.per_expert_scale",
    "pre_ffw_norm_2.weight": "pre_feedforward_layernorm_2.weight",
    "post_ffw_norm_1.weight": "post_feedforward_layernorm_1.weight",
    "post_ffw_norm_2.weight": "post_feedforward_layernorm_2.weight",
}
TOP_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "per_layer_token_embd.weight": "model.embed_tokens_per_layer.weight",
    "per_layer_model_proj.weight": "model.per_layer_model_projection.weight",
    "per_layer_proj_norm.weight": "model.per_layer_projection_norm.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
ROPE_FREQS = "rope_freqs.weight"
UNROTATED = 1e30  # the converter's factor for a pair proportional RoPE leaves still


def hf_name(gguf_name: str) -> str | None:
    """transformers' name for a tensor of a Gemma 4 file; None for one it has no place for."""
    if gguf_name.startswith("blk."):
        block, _, rest = gguf_name.removeprefix("blk.").partition(".")
        within = BLOCK_NAMES.get(rest)
        return f"model.layers.{block}.{within}" if block.isdigit() and within else None
    return TOP_NAMES.get(gguf_name)


def per_layer(value: Any, layers: int, what: str) -> tuple[list[Any] | None, str | None]:
    """A setting given once or once per layer, as one value per layer; or what is wrong with it."""
    values = value if isinstance(value, list) else [value] * layers
    if len(values) != layers or any(isinstance(v, bool) or not isinstance(v, int) for v in values):
        return (
            None,
            f"its {what} ({value!r}) is neither a whole number nor one per each of its {layers} blocks",
        )
    return values, None


def rotated_share(factors: list[float] | None) -> tuple[float | None, str | None]:
    """The share of a full layer's pairs its RoPE turns, from the `rope_freqs` the converter
    writes (1 on a turned pair, 1e30 on a still one, the turned ones first): 1.0 without it."""
    if factors is None:
        return 1.0, None
    still = [f >= UNROTATED / 2 for f in factors]  # stored as float32: 1e30 comes back inexact
    turned = still.index(True) if True in still else len(factors)
    if any(f != 1.0 for f in factors[:turned]) or not all(still[turned:]):
        return None, "its rope_freqs is no proportional RoPE (1 on the turned pairs, then 1e30)"
    return turned / len(factors), None


def config_fields(
    key: Callable[[str], Any], names: Mapping[str, Any], factors: list[float] | None
) -> tuple[dict[str, Any] | None, str | None]:
    """Gemma4TextConfig's layout fields from the metadata (`key`: an `arch.`-relative getter) and
    the file's tensor names (`names`); or a line saying which setting contradicts the rest."""
    layers = key("block_count")
    pattern = key("attention.sliding_window_pattern")
    if not isinstance(layers, int) or not isinstance(pattern, list) or len(pattern) != layers:
        return (
            None,
            f"its attention.sliding_window_pattern ({pattern!r}) is not one bool per each of its "
            f"{layers} blocks",
        )
    kinds = ["sliding_attention" if sliding else "full_attention" for sliding in pattern]
    kv_heads, problem = per_layer(key("attention.head_count_kv"), layers, "attention.head_count_kv")
    widths, problem = (
        (None, problem) if problem else per_layer(key("feed_forward_length"), layers, "feed_forward_length")
    )
    if problem:
        return None, problem
    shared = key("attention.shared_kv_layers") or 0
    if not isinstance(shared, int) or not 0 <= shared < layers:
        return None, f"its attention.shared_kv_layers ({shared!r}) is not fewer than its {layers} blocks"
    share, problem = rotated_share(factors)
    if problem:
        return None, problem
    sliding, full = (
        kinds.index(kind) if kind in kinds else 0 for kind in ("sliding_attention", "full_attention")
    )
    first_shared = layers - shared
    owners = [i for i in range(first_shared) if kinds[i] == "full_attention"]
    base = widths[0]
    double = shared > 0 and widths[first_shared] == 2 * base
    fields = {
        "layer_types": kinds,
        "head_dim": key("attention.key_length_swa", key("attention.key_length")),
        "global_head_dim": key("attention.key_length"),
        "num_key_value_heads": kv_heads[sliding],
        "num_global_key_value_heads": kv_heads[full],
        "intermediate_size": base,
        "use_double_wide_mlp": double,
        "num_kv_shared_layers": shared,
        "attention_k_eq_v": bool(owners) and all(f"blk.{i}.attn_v.weight" not in names for i in owners),
        "sliding_window": key("attention.sliding_window"),
        "final_logit_softcapping": key("final_logit_softcapping"),
        "hidden_size_per_layer_input": key("embedding_length_per_layer_input") or 0,
        "hidden_activation": "gelu_pytorch_tanh",
        **_expert_fields(key, "blk.0.ffn_gate_inp.weight" in names),
        "rope_parameters": {
            "full_attention": {
                "rope_type": "proportional",
                "partial_rotary_factor": share,
                "rope_theta": float(key("rope.freq_base", 1_000_000.0)),
            },
            "sliding_attention": {
                "rope_type": "default",
                "rope_theta": float(key("rope.freq_base_swa", 10_000.0)),
            },
        },
    }
    expected = [2 * base if double and i >= first_shared else base for i in range(layers)]
    if widths != expected:
        return None, f"its feed_forward_length ({widths}) is not {expected} as its other settings imply"
    return fields, None


def layer_settings(config: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Each block's settings as a uniform model's config names them (its head width and KV heads
    per kind, its MLP's width, double on a shared layer of a double-wide MLP), for the shapes
    llama.cpp's loader checks."""
    from types import SimpleNamespace

    from llmcli.models.gemma4_layout import layer_shapes

    first_shared = config["num_hidden_layers"] - config["num_kv_shared_layers"]
    return [
        config
        | {
            "head_dim": width,
            "num_key_value_heads": kv_heads,
            "intermediate_size": config["intermediate_size"]
            * (2 if config["use_double_wide_mlp"] and index >= first_shared else 1),
        }
        for index, (width, kv_heads) in enumerate(layer_shapes(SimpleNamespace(**config)))
    ]


def own_shapes(config: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
    """The shapes of the tensors a Gemma 4 block holds beyond a Llama block's: its per-layer
    input's and its experts'."""
    hidden, per_input = config["hidden_size"], config["hidden_size_per_layer_input"]
    return {
        "inp_gate.weight": (per_input, hidden),
        "proj.weight": (hidden, per_input),
        **_expert_shapes(config),
    }


def _expert_fields(key: Callable[[str], Any], sparse: bool) -> dict[str, Any]:
    """The MoE's settings, for a file whose blocks hold a router."""
    if not sparse:
        return {"enable_moe_block": False}
    return {
        "enable_moe_block": True,
        "num_experts": key("expert_count"),
        "top_k_experts": key("expert_used_count"),
        "moe_intermediate_size": key("expert_feed_forward_length"),
    }


def required(config: Mapping[str, Any]) -> list[str]:
    """The tensors (by their names in the file) a file of `config` must hold: gemma4_layout's
    list for a checkpoint (a KV-reading layer has no keys or values; a full layer whose keys are
    its values has no attn_v), in the file's names."""
    from types import SimpleNamespace

    from llmcli.models.gemma4_layout import expected_tensors

    top = {hf: name for name, hf in TOP_NAMES.items()}
    within = {hf: name for name, hf in BLOCK_NAMES.items()}
    names = []
    for hf in expected_tensors(SimpleNamespace(**config)):
        if hf in top:
            names.append(top[hf])
            continue
        block, _, rest = hf.removeprefix("model.layers.").partition(".")
        if rest in within:
            names.append(f"blk.{block}.{within[rest]}")
    return names


def _expert_shapes(config: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
    if not config.get("enable_moe_block"):
        return {}
    hidden, experts, inner = config["hidden_size"], config["num_experts"], config["moe_intermediate_size"]
    return {
        "ffn_gate_inp.weight": (experts, hidden),
        "ffn_gate_inp.scale": (hidden,),
        "ffn_gate_up_exps.weight": (experts, 2 * inner, hidden),
        "ffn_down_exps.weight": (experts, hidden, inner),
        "ffn_down_exps.scale": (experts,),
    }
