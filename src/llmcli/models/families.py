"""The model families the native engine runs: one row per architecture, holding everything the
loader needs to know about it, torch-free (so `models show`, the quantizer's checks and the
GGUF reader can ask before anything heavy is imported).

A row names its engine module (engine/native/families/<runtime>.py, which holds only the
runtime blocks), the defaults transformers' configuration class fills in for it, the tensors
its config implies beyond the weights, how its layers' kinds and RoPE are settled, its experts,
and how llama.cpp names its GGUF files. Adding a family is a row here and, for a new kind of
block, a module there; tests/test_family_table.py holds the two to each other and the defaults
to transformers' own.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

# The engine's family modules, in the order its refusal lists them, each as it names them there.
RUNTIMES: dict[str, str] = {
    "llama": "Llama",
    "phi3": "Phi-3",
    "gemma3": "Gemma 2 and 3",
    "gpt_oss": "gpt-oss",
    "moe": "a sparse MoE",
    "qwen3_5": "Qwen3.5 and Qwen3-Next",
    "gemma4": "Gemma 4",
}


@dataclass(frozen=True)
class Family:
    """One architecture the native engine runs, as the loader, the quantizer's checks and the GGUF
    reader need to know it; what is not said here is the Llama family's way."""

    architecture: str  # transformers' class name, as config.json's `architectures` gives it
    runtime: str  # its engine module: a key of RUNTIMES
    # What its configuration class fills in where config.json is silent, over the Llama
    # family's (lean_config.DEFAULTS).
    config_defaults: Mapping[str, Any]
    # How its layers' kinds are settled where config.json names none: "alternating": sliding
    # and full in turn, the first sliding; "gemma3": as Gemma3TextConfig settles them (every
    # `sliding_window_pattern`-th layer full, a RoPE table per kind of layer, an embedding
    # model's bidirectional attention refused); "linear": as Qwen3_5TextConfig settles them
    # (every `full_attention_interval`-th layer full attention, the others Gated DeltaNet);
    # "gemma4": as Gemma4TextConfig settles them (gemma4_layout.py: a head width, KV heads and
    # RoPE per kind, KV shared across layers).
    layer_types: Literal["alternating", "gemma3", "linear", "gemma4"] | None = None
    default_rope: Mapping[str, Any] | None = None  # its RoPE where config.json names none
    # RoPE "su" and "yarn" are this family's older names for "longrope" (Phi-3).
    longrope_aliases: bool = False
    activation: tuple[str, str] = ("hidden_act", "silu")  # the config field, and the one value read
    # Which projections have a bias: "none"; "qkv" (always); "attention" (q/k/v/o where
    # `attention_bias`); "attention+mlp" (and the MLP's where `mlp_bias`).
    biases: Literal["none", "qkv", "attention", "attention+mlp"] = "attention"
    head_norms: bool = False  # q_norm and k_norm in each attention
    ffn_norms: bool = False  # norms before and after the MLP (Gemma's)
    sinks: bool = False  # an attention sink logit per head
    embed_scale: bool = False  # embeddings multiplied by √hidden_size
    # Norms kept in fp32 in an fp16 model (transformers' `_keep_in_fp32_modules`).
    fp32_norms: frozenset[str] = frozenset()
    # A sparse family's experts: "per-expert" (one tensor per expert, restacked on load, where
    # `expert_layout` says) or "stacked" (gpt-oss's, as stored). llmcli's int8/int4 quantize
    # them on a CPU only (a GPU decode step gathers experts by index, which needs a gathered
    # kernel not written yet), and bitsandbytes not at all.
    experts: Literal["per-expert", "stacked"] | None = None
    expert_layout: tuple[str, tuple[str, str, str]] | None = None  # where, and gate/up/down's names
    # Beside the routed experts, a gated MLP every token goes through (`mlp.shared_expert`), its
    # output scaled by sigmoid(`mlp.shared_expert_gate`): Qwen3.5-MoE's and Qwen3-Next's.
    shared_expert: bool = False
    # Its Gated DeltaNet layers' input projections as Qwen3-Next stores them: two matrices
    # (`in_proj_qkvz`, `in_proj_ba`) whose rows are grouped per key head; else Qwen3.5's four.
    grouped_deltanet_projections: bool = False
    # A vision-language checkpoint's text part, which is what the native engine runs of it: where
    # its language model's tensors lie (for `model.`), its config that of config.json's
    # `text_config`. An image is refused (the server reads text parts only).
    language_model: str | None = None
    mxfp4_on_cpu: bool = False  # MXFP4 experts dequantized on a CPU, as transformers' path does
    # llama.cpp's architecture names for files of this family that llmcli reads in place.
    gguf: tuple[str, ...] = ()
    # llama.cpp's converter interleaved the rotary halves of each q and k head (its RoPE pairs
    # neighbours); transformers' layout pairs halves, so those rows are put back.
    gguf_permuted: bool = False
    # What llama.cpp's loader requires of a block beyond a Llama one (it loads a `qwen2` file
    # without its q/k/v biases, and runs it so, as llmcli does).
    gguf_required: frozenset[str] = frozenset()

    @property
    def rope_per_kind(self) -> bool:
        """A RoPE table per kind of layer (Gemma 3's local and global ones)."""
        return self.layer_types in ("gemma3", "gemma4")


# What Gemma2Config and Gemma3TextConfig both fill in.
_GEMMA: dict[str, Any] = {
    "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh",
    "tie_word_embeddings": True,
    "pad_token_id": 0,
    "eos_token_id": 1,
    "bos_token_id": 2,
    "query_pre_attn_scalar": 256,
    "sliding_window": 4096,
    "use_bidirectional_attention": None,
}
_GEMMA_SHAPE: dict[str, Any] = {
    "runtime": "gemma3",
    "activation": ("hidden_activation", "gelu_pytorch_tanh"),
    "ffn_norms": True,
    "embed_scale": True,
}

# What Gemma3ForCausalLM and the text part of Gemma3ForConditionalGeneration share.
_GEMMA3: dict[str, Any] = {
    "config_defaults": _GEMMA
    | {
        "max_position_embeddings": 131_072,
        "sliding_window_pattern": 6,
        "final_logit_softcapping": None,
        "attn_logit_softcapping": None,
        "use_bidirectional_attention": False,
    },
    "layer_types": "gemma3",
    "head_norms": True,
    **_GEMMA_SHAPE,
}
# What Qwen3_5TextConfig fills in (Qwen3_5MoeTextConfig and Qwen3NextConfig too), and how
# their rows read the checkpoint.
_QWEN3_5: dict[str, Any] = {
    "head_dim": 256,
    "max_position_embeddings": 32768,
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 32,
}
_QWEN3_5_SHAPE: dict[str, Any] = {
    "layer_types": "linear",
    # Qwen3_5TextConfig's RoPE where config.json names none: a quarter of each head rotated.
    "default_rope": {"rope_type": "default", "partial_rotary_factor": 0.25},
    "head_norms": True,
}
_QWEN3_5_MOE: dict[str, Any] = _QWEN3_5 | {
    "moe_intermediate_size": 512,
    "shared_expert_intermediate_size": 512,
    "num_experts_per_tok": 8,
    "num_experts": 256,
}
_SHARED_EXPERTS: dict[str, Any] = {
    "experts": "per-expert",
    "expert_layout": ("mlp", ("gate_proj", "up_proj", "down_proj")),
    "shared_expert": True,
}
_LANGUAGE_MODEL: dict[str, Any] = {"language_model": "model.language_model"}
_ROWS = (
    Family("LlamaForCausalLM", "llama", {}, biases="attention+mlp", gguf=("llama",), gguf_permuted=True),
    Family("MistralForCausalLM", "llama", {}, biases="none"),
    # SmolVLM's and Idefics3's vision-language checkpoints: a Llama (SmolLM2, Llama 3) as their
    # language model, under `model.text_model.`; the native engine runs that.
    *(
        Family(architecture, "llama", {}, biases="attention+mlp", language_model="model.text_model")
        for architecture in ("SmolVLMForConditionalGeneration", "Idefics3ForConditionalGeneration")
    ),
    # Qwen's configs carry a window they use only where `use_sliding_window` says so (default off).
    Family("Qwen2ForCausalLM", "llama", {"use_sliding_window": False}, biases="qkv", gguf=("qwen2",)),
    # Its text part is Qwen2's, under `model.` as released (the tower under `visual.`), with
    # multimodal RoPE for an image's rows (models/vision/qwen_vl.py reads the tower).
    Family(
        "Qwen2_5_VLForConditionalGeneration",
        "llama",
        {"use_sliding_window": False},
        biases="qkv",
        language_model="model",
    ),
    Family(
        "Qwen3ForCausalLM",
        "llama",
        {"use_sliding_window": False, "head_dim": 128},
        head_norms=True,
        gguf=("qwen3",),
        gguf_required=frozenset({"attn_q_norm.weight", "attn_k_norm.weight"}),
    ),
    Family(
        "Qwen3MoeForCausalLM",
        "moe",
        {"max_position_embeddings": 32768, "norm_topk_prob": False, "use_sliding_window": False},
        head_norms=True,
        experts="per-expert",
        expert_layout=("mlp", ("gate_proj", "up_proj", "down_proj")),
    ),
    Family(
        "MixtralForCausalLM",
        "moe",
        {"rms_norm_eps": 1e-5, "max_position_embeddings": 4096 * 32},
        biases="none",
        experts="per-expert",
        expert_layout=("block_sparse_moe", ("w1", "w3", "w2")),
    ),
    Family(
        "Phi3ForCausalLM",
        "phi3",
        {
            "rms_norm_eps": 1e-5,
            "max_position_embeddings": 4096,
            "original_max_position_embeddings": 4096,
            "bos_token_id": 1,
            "eos_token_id": 32000,
            "pad_token_id": 32000,
        },
        biases="none",
        longrope_aliases=True,
    ),
    Family("Gemma3ForCausalLM", **_GEMMA3),
    # Its text part, where Google's release (and transformers' save) keep it; the vision tower is
    # read on the first image (models/vision/gemma3.py).
    Family("Gemma3ForConditionalGeneration", **_GEMMA3, language_model="language_model.model"),
    Family(
        "Gemma2ForCausalLM",
        config_defaults=_GEMMA
        | {"max_position_embeddings": 8192, "final_logit_softcapping": 30.0, "attn_logit_softcapping": 50.0},
        layer_types="alternating",
        **_GEMMA_SHAPE,
    ),
    Family(
        "GptOssForCausalLM",
        "gpt_oss",
        {
            "num_local_experts": 128,
            "num_experts_per_tok": 4,
            "head_dim": 64,
            "sliding_window": 128,
            "max_position_embeddings": 131_072,
            "rms_norm_eps": 1e-5,
            "rope_theta": 150_000.0,
            "swiglu_alpha": 1.702,
            "swiglu_limit": 7.0,
            "attention_bias": True,
        },
        layer_types="alternating",
        # GptOssConfig's RoPE where config.json names none: YaRN from 4096 positions, 32 times over.
        default_rope={
            "rope_type": "yarn",
            "factor": 32.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": 4096,
        },
        sinks=True,
        fp32_norms=frozenset({"input_layernorm", "post_attention_layernorm", "norm"}),
        experts="stacked",
        mxfp4_on_cpu=True,
    ),
    Family("Qwen3_5ForCausalLM", "qwen3_5", _QWEN3_5, **_QWEN3_5_SHAPE, gguf=("qwen35",)),
    Family(
        "Qwen3_5MoeForCausalLM",
        "qwen3_5",
        _QWEN3_5_MOE,
        **_QWEN3_5_SHAPE,
        **_SHARED_EXPERTS,
        gguf=("qwen35moe",),
    ),
    # Their vision-language checkpoints, of which the native engine runs the language model.
    Family("Qwen3_5ForConditionalGeneration", "qwen3_5", _QWEN3_5, **_QWEN3_5_SHAPE, **_LANGUAGE_MODEL),
    Family(
        "Qwen3_5MoeForConditionalGeneration",
        "qwen3_5",
        _QWEN3_5_MOE,
        **_QWEN3_5_SHAPE | _SHARED_EXPERTS | _LANGUAGE_MODEL,
    ),
    Family(
        "Qwen3NextForCausalLM",
        "qwen3_5",
        _QWEN3_5_MOE
        | {
            "intermediate_size": 5632,  # its dense layers' (`mlp_only_layers`)
            "num_experts_per_tok": 10,
            "num_experts": 512,
            "norm_topk_prob": True,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
        },
        **_QWEN3_5_SHAPE,
        **_SHARED_EXPERTS,
        grouped_deltanet_projections=True,
        gguf=("qwen3next",),
    ),
)
# What Gemma4ForCausalLM and the text part of Gemma4ForConditionalGeneration share.
_GEMMA4: dict[str, Any] = {
    "runtime": "gemma4",
    # Gemma4TextConfig's (no query_pre_attn_scalar: its attention scores are not scaled).
    "config_defaults": {key: value for key, value in _GEMMA.items() if key != "query_pre_attn_scalar"}
    | {
        "max_position_embeddings": 131_072,
        "sliding_window": 512,
        "num_key_value_heads": 4,
        "final_logit_softcapping": None,
        "vocab_size_per_layer_input": 262_144,
        "hidden_size_per_layer_input": 256,
        "attention_k_eq_v": False,
        "num_kv_shared_layers": 0,
        "enable_moe_block": False,
        "use_double_wide_mlp": False,
        "num_experts": None,
        "top_k_experts": None,
        "moe_intermediate_size": None,
    },
    "layer_types": "gemma4",
    "head_norms": True,
    "activation": _GEMMA_SHAPE["activation"],
    "ffn_norms": True,
    "embed_scale": True,
}
_ROWS += (
    Family("Gemma4ForCausalLM", **_GEMMA4, gguf=("gemma4",)),
    Family("Gemma4ForConditionalGeneration", **_GEMMA4, **_LANGUAGE_MODEL),
)
FAMILIES: dict[str, Family] = {row.architecture: row for row in _ROWS}
BY_GGUF: dict[str, Family] = {name: row for row in _ROWS for name in row.gguf}


def family(architecture: str | None) -> Family | None:
    """The row of `architecture`; None: the native engine does not run it."""
    return FAMILIES.get(architecture) if architecture is not None else None


def family_of_config(config: Mapping[str, Any]) -> Family | None:
    """The row of the architecture config.json names first."""
    return family((config.get("architectures") or [None])[0])


def by_gguf(name: str) -> Family | None:
    """The row whose GGUF files llama.cpp names `name` (`llama`, `qwen2`, …); None: llmcli does
    not read such a file in place."""
    return BY_GGUF.get(name)
