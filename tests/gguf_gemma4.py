"""A Gemma 4 folder written as a GGUF file the way llama.cpp's convert_hf_to_gguf.py writes one
(its Gemma4Model: architecture `gemma4`), with gguf's own writer and tensor-name table, for tests
and scripts; written from the converter's behaviour independently of the reader
(models/gguf_gemma4.py reads it back).

What the converter does: tensors stored as they are (no norm plus one), named by gguf's Gemma 4
map; the layout per layer in the metadata (a sliding-window pattern of bools, KV heads and MLP
widths per layer, the shared layers' count), the full and sliding head widths under key_length
and key_length_swa, and the full layers' proportional RoPE as a `rope_freqs` tensor (1 on each
turned pair, 1e30 on the others). The tokenizer here is the tiny folder's byte-level BPE, as
tests/gguf_qwen35.py records it (a published file's is llama.cpp's `gemma4` model)."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from gguf_qwen35 import _gguf_type, _tokenizer_metadata

ARCH = "gemma4"


def write_gemma4_gguf(
    folder: Path,
    target: Path,
    *,
    half: bool = False,
    q8_0: bool = False,
    metadata: Mapping[str, Any] | None = None,
    keep: Callable[[str], bool] = lambda name: True,
) -> Path:
    """`folder` (a Gemma 4 text model saved by transformers) as `target`: matrices F16 where
    `half`, Q8_0 where `q8_0` (gguf's own quantization), else F32, everything of one dimension
    F32; `metadata` overrides keys (None leaves one out); tensors kept by `keep` (their names in
    the file)."""
    import gguf
    from safetensors.torch import load_file

    from llmcli.models.gemma4_layout import layer_shapes

    config = json.loads((folder / "config.json").read_text())
    layers, kinds = config["num_hidden_layers"], config["layer_types"]
    shapes = layer_shapes(_Config(config))
    shared = config["num_kv_shared_layers"]
    width = config["intermediate_size"]
    double = config.get("use_double_wide_mlp") and shared > 0
    full = next(i for i, kind in enumerate(kinds) if kind == "full_attention")
    sliding = next(i for i, kind in enumerate(kinds) if kind == "sliding_attention")
    rope = config["rope_parameters"]
    global_dim = shapes[full][0]
    turned = int(global_dim * rope["full_attention"]["partial_rotary_factor"]) // 2
    values: dict[str, Any] = {
        f"{ARCH}.block_count": layers,
        f"{ARCH}.context_length": config["max_position_embeddings"],
        f"{ARCH}.embedding_length": config["hidden_size"],
        f"{ARCH}.embedding_length_per_layer_input": config["hidden_size_per_layer_input"],
        f"{ARCH}.feed_forward_length": [
            width * (2 if double and i >= layers - shared else 1) for i in range(layers)
        ],
        f"{ARCH}.attention.head_count": config["num_attention_heads"],
        f"{ARCH}.attention.head_count_kv": [kv for _, kv in shapes],
        f"{ARCH}.attention.key_length": global_dim,
        f"{ARCH}.attention.value_length": global_dim,
        f"{ARCH}.attention.key_length_swa": shapes[sliding][0],
        f"{ARCH}.attention.value_length_swa": shapes[sliding][0],
        f"{ARCH}.attention.layer_norm_rms_epsilon": config["rms_norm_eps"],
        f"{ARCH}.attention.sliding_window": config["sliding_window"],
        f"{ARCH}.attention.sliding_window_pattern": [kind == "sliding_attention" for kind in kinds],
        f"{ARCH}.attention.shared_kv_layers": shared,
        f"{ARCH}.rope.freq_base": rope["full_attention"]["rope_theta"],
        f"{ARCH}.rope.freq_base_swa": rope["sliding_attention"]["rope_theta"],
        f"{ARCH}.rope.dimension_count": global_dim,
        f"{ARCH}.rope.dimension_count_swa": shapes[sliding][0],
        f"{ARCH}.final_logit_softcapping": config["final_logit_softcapping"],
        **_expert_metadata(config),
        "general.file_type": 1 if half else 0,
        **_tokenizer_metadata(folder, config),
    }
    values.update(metadata or {})
    writer = gguf.GGUFWriter(str(target), ARCH)
    for key, value in values.items():
        if value is None:
            continue
        if isinstance(value, list) and isinstance(value[0], bool):
            writer.add_array(key, value)  # gguf's writer types a bool array itself
        else:
            writer.add_key_value(key, value, *_gguf_type(value))
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GEMMA4, layers)
    stored: dict[str, torch.Tensor] = {}
    for hf, tensor in load_file(folder / "model.safetensors").items():
        name = _ROUTER_SCALES.get(hf.rpartition(".router.")[2]) if ".router." in hf else None
        name = name and f"blk.{hf.split('.')[2]}.{name}"  # the converter's names for the router's scales
        name = name or names.get_name(hf, try_suffixes=(".weight", ".bias"))
        assert name is not None, hf
        # layer_scalar has no suffix in transformers; llama.cpp's loader reads it as a `.weight`
        stored[name if name.endswith((".weight", ".bias", ".scale")) else f"{name}.weight"] = tensor.float()
    factors = torch.full((global_dim // 2,), 1e30)
    factors[:turned] = 1.0
    stored["rope_freqs.weight"] = factors
    for name, data in stored.items():
        if keep(name) and q8_0 and data.ndim == 2 and data.shape[-1] % 32 == 0:
            from gguf.quants import quantize

            kind = gguf.GGMLQuantizationType.Q8_0
            writer.add_tensor(name, quantize(data.numpy(), kind), raw_dtype=kind)
        elif keep(name):
            matrix = data.ndim >= 2
            writer.add_tensor(
                name, np.ascontiguousarray(data.numpy().astype(np.float16 if half and matrix else np.float32))
            )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return target


# The router's scales, which gguf's tensor map has no name for, as the converter names them.
_ROUTER_SCALES = {"scale": "ffn_gate_inp.scale", "per_expert_scale": "ffn_down_exps.scale"}


def _expert_metadata(config: Mapping[str, Any]) -> dict[str, Any]:
    if not config.get("enable_moe_block"):
        return {}
    return {
        f"{ARCH}.expert_count": config["num_experts"],
        f"{ARCH}.expert_used_count": config["top_k_experts"],
        f"{ARCH}.expert_feed_forward_length": config["moe_intermediate_size"],
    }


class _Config:
    """config.json's values as attributes (gemma4_layout reads a config object)."""

    def __init__(self, values: Mapping[str, Any]) -> None:
        self.__dict__.update(values)
