"""A Qwen3.5, Qwen3.5-MoE or Qwen3-Next folder written as a GGUF file the way llama.cpp's
convert_hf_to_gguf.py writes one (its Qwen3_5TextModel, Qwen3_5MoeTextModel and Qwen3NextModel:
architectures `qwen35`, `qwen35moe` and `qwen3next`), with gguf's own writer and tensor-name
table, for tests and scripts: llmcli's reader is held to what llama.cpp's converter does, written
here from its source independently of the reader (models/gguf_deltanet.py undoes it).

The converter's transforms: every norm but the DeltaNet's gated one stored plus one; A_log as
−exp(A_log) (`ssm_a`); dt_bias as `ssm_dt.bias`; the convolution squeezed to [channels, kernel];
for Qwen3.5 (dense and MoE), value heads reordered from grouped-by-key-head to tiled where a key
head serves several, and RoPE's (text) sections; for Qwen3-Next, its in_proj_qkvz split into
`attn_qkv` (every head's q, every k, every v) and `attn_gate` (every z), its in_proj_ba kept
(`ssm_ba`); the experts stacked per matrix (Qwen2MoeModel's merge), their counts and widths under
`expert_*`; the DeltaNet's sizes under `ssm.*`, RoPE's rotated width."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

NORMAL, CONTROL = 1, 3  # llama.cpp's token types


def tiled(tensor: torch.Tensor, dim: int, key_heads: int, per_key: int, width: int) -> torch.Tensor:
    """llama.cpp's _reorder_v_heads: value heads along `dim` from grouped to tiled order."""
    shape = list(tensor.shape)
    split = tensor.reshape(*shape[:dim], key_heads, per_key, width, *shape[dim + 1 :])
    return split.transpose(dim, dim + 1).reshape(shape)


# The converter of each architecture: its `general.architecture`, and whether it tiles value heads.
ARCHITECTURES = {
    "Qwen3_5ForCausalLM": ("qwen35", True),
    "Qwen3_5MoeForCausalLM": ("qwen35moe", True),
    "Qwen3NextForCausalLM": ("qwen3next", False),
}


def converted(
    name: str, tensor: torch.Tensor, config: Mapping[str, Any], back: bool = False
) -> tuple[str, torch.Tensor]:
    """(transformers' name after the converter's renames, the tensor as the converter stores it).
    `back`: a matrix's value heads from tiled to grouped again (its reordering undone)."""
    key_heads, value_heads = config["linear_num_key_heads"], config["linear_num_value_heads"]
    key_dim, width = key_heads * config["linear_key_head_dim"], config["linear_value_head_dim"]
    per_key = value_heads // key_heads
    tiles = ARCHITECTURES[config["architectures"][0]][1]
    if back:  # tiled is grouped with the two counts swapped: the same reshape undoes it
        key_heads, per_key = per_key, key_heads
    if tiles and per_key > 1 and ".linear_attn." in name:
        if ".in_proj_qkv." in name or ".conv1d." in name:  # q and k, then the value heads
            data = tensor.reshape(tensor.shape[0], -1)
            values = tiled(data[2 * key_dim :], 0, key_heads, per_key, width)
            tensor = torch.cat((data[: 2 * key_dim], values))
        elif ".in_proj_z." in name:
            tensor = tiled(tensor, 0, key_heads, per_key, width)
        elif ".in_proj_a." in name or ".in_proj_b." in name or name.endswith((".A_log", ".dt_bias")):
            tensor = tiled(tensor, 0, key_heads, per_key, 1)
        elif ".out_proj." in name:
            tensor = tiled(tensor, 1, key_heads, per_key, width)
    if name.endswith(".A_log"):
        tensor = -torch.exp(tensor)
    elif name.endswith(".dt_bias"):
        name = name.removesuffix(".dt_bias") + ".dt_proj.bias"
    elif "conv1d" in name:
        tensor = tensor.squeeze()
    elif name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
        tensor = tensor + 1
    return name, tensor


def split_qkvz(tensor: torch.Tensor, config: Mapping[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen3NextModel's split of in_proj_qkvz ([q, k, v, z] rows of each key head in turn) into
    attn_qkv (every head's q, then every k, then every v) and attn_gate (every z)."""
    heads, key_dim = config["linear_num_key_heads"], config["linear_key_head_dim"]
    values = config["linear_num_value_heads"] // heads * config["linear_value_head_dim"]
    hidden = tensor.shape[1]
    q, k, v, z = torch.split(tensor.reshape(heads, -1, hidden), [key_dim, key_dim, values, values], 1)
    return torch.cat([part.reshape(-1, hidden) for part in (q, k, v)]), z.reshape(-1, hidden)


def tiny_qwen35(folder: Path, arch: str = "qwen3_5") -> Path:
    """tests/tiny_models.py's Qwen3.5 (2 key heads serving 4 value heads: the file reorders them)
    — or its `arch`, "qwen3_5_moe" or "qwen3_next" (every layer sparse here, as llama.cpp's
    `qwen3next` has no dense one) — with every weight a value fp16 holds, so that an F16 file
    holds the folder's model exactly, and random norms, A_log and dt_bias (transformers starts
    the norms at zero, where a norm stored plus one and read back without the one taken off
    would still read as the folder's)."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    from tiny_models import build_tiny_model

    build_tiny_model(folder, arch)
    if arch == "qwen3_next":
        config = AutoConfig.from_pretrained(folder)
        config.mlp_only_layers = []
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    weights = load_file(folder / "model.safetensors")
    generator = torch.Generator().manual_seed(3)
    for name, tensor in weights.items():
        if tensor.ndim == 1:  # norms, A_log, dt_bias
            tensor = tensor + 0.3 * torch.randn(tensor.shape, generator=generator)
        weights[name] = tensor.half().float()
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


def q8_0_exact(folder: Path) -> Path:
    """The folder's matrices made values a Q8_0 file holds exactly, as the converter lays them
    out (value heads tiled: a block of 32 spans two of them), so that the Q8_0 file of it
    dequantizes to the folder's own weights."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize
    from safetensors.torch import load_file, save_file

    config = json.loads((folder / "config.json").read_text())
    weights = load_file(folder / "model.safetensors")
    for name, tensor in weights.items():
        if tensor.ndim != 2:
            continue
        stored = converted(name, tensor, config)[1].numpy()
        blocks = quantize(stored, GGMLQuantizationType.Q8_0)
        exact = torch.from_numpy(dequantize(blocks, GGMLQuantizationType.Q8_0).reshape(stored.shape))
        weights[name] = converted(name, exact, config, back=True)[1].contiguous()
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


def write_qwen35_gguf(
    folder: Path,
    target: Path,
    *,
    half: bool = False,
    q8_0: bool = False,
    mtp: bool = False,
    metadata: Mapping[str, Any] | None = None,
    keep: Callable[[str], bool] = lambda name: True,
) -> Path:
    """`folder` (a Qwen3.5 text model saved by transformers, with a byte-level BPE tokenizer)
    as `target`: matrices F16 where `half`, Q8_0 where `q8_0` (as llama.cpp's quantizer makes
    them: gguf's own quantization, the shared expert's gate a vector), else F32; everything of
    one dimension, the convolution and the router F32, as the converter keeps them (llama.cpp's
    convolution takes no other type). `mtp`: an
    MTP block after the model's own, as the converter writes Qwen3.5's MTP layer (a `nextn`
    block counted in block_count: here its last layer's tensors again, and the nextn
    projection and norms, random). `metadata` overrides keys (by their whole names; None leaves
    one out); tensors kept by `keep` (their names in the file)."""
    import gguf
    from safetensors.torch import load_file

    config = json.loads((folder / "config.json").read_text())
    layers, kinds = config["num_hidden_layers"], config["layer_types"]
    interval = config.get("full_attention_interval") or kinds.index("full_attention") + 1
    assert kinds == [("linear_attention", "full_attention")[(i + 1) % interval == 0] for i in range(layers)]
    rope = config["rope_parameters"]
    rotated = int(config["head_dim"] * rope.get("partial_rotary_factor", 0.25))
    arch, tiles = ARCHITECTURES[config["architectures"][0]]
    values: dict[str, Any] = {
        f"{arch}.block_count": layers + mtp,
        f"{arch}.context_length": config["max_position_embeddings"],
        f"{arch}.embedding_length": config["hidden_size"],
        f"{arch}.feed_forward_length": config["intermediate_size"],
        f"{arch}.attention.head_count": config["num_attention_heads"],
        f"{arch}.attention.head_count_kv": config["num_key_value_heads"],
        f"{arch}.attention.key_length": config["head_dim"],
        f"{arch}.attention.value_length": config["head_dim"],
        f"{arch}.attention.layer_norm_rms_epsilon": config["rms_norm_eps"],
        f"{arch}.rope.freq_base": rope["rope_theta"],
        f"{arch}.rope.dimension_count": rotated,
        f"{arch}.ssm.conv_kernel": config["linear_conv_kernel_dim"],
        f"{arch}.ssm.state_size": config["linear_key_head_dim"],
        f"{arch}.ssm.group_count": config["linear_num_key_heads"],
        f"{arch}.ssm.time_step_rank": config["linear_num_value_heads"],
        f"{arch}.ssm.inner_size": config["linear_value_head_dim"] * config["linear_num_value_heads"],
        f"{arch}.full_attention_interval": interval,
        "general.file_type": 7 if q8_0 else 1 if half else 0,
        **({f"{arch}.nextn_predict_layers": 1} if mtp else {}),
        **_expert_metadata(arch, config),
        **_rope_sections(arch, rope, rotated),
        **_tokenizer_metadata(folder, config),
    }
    values.update(metadata or {})
    values = {key: value for key, value in values.items() if value is not None}  # None: left out
    writer = gguf.GGUFWriter(str(target), arch)
    for key, value in values.items():
        writer.add_key_value(key, value, *_gguf_type(value))
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], layers)
    stored: dict[str, torch.Tensor] = {}
    for hf, tensor in _converter_input(load_file(folder / "model.safetensors"), config).items():
        renamed, data = converted(hf, tensor.float(), config)
        name = names.get_name(renamed, try_suffixes=(".weight", ".bias"))
        assert name is not None, renamed
        if ".attn_qkv." in name and not tiles:  # Qwen3-Next's in_proj_qkvz, split in two
            data, stored[name.replace(".attn_qkv.", ".attn_gate.")] = split_qkvz(data, config)
        stored[name] = data
        if mtp and name.startswith(f"blk.{layers - 1}."):
            assert kinds[-1] == "full_attention"  # an MTP layer is one
            stored[name.replace(f"blk.{layers - 1}.", f"blk.{layers}.")] = data.clone()
    if mtp:
        hidden, generator = config["hidden_size"], torch.Generator().manual_seed(11)
        stored[f"blk.{layers}.nextn.eh_proj.weight"] = torch.randn(hidden, 2 * hidden, generator=generator)
        for norm in ("enorm", "hnorm", "shared_head_norm"):
            stored[f"blk.{layers}.nextn.{norm}.weight"] = 1 + torch.randn(hidden, generator=generator)
    for name, data in stored.items():
        if not keep(name):
            continue
        if q8_0 and ".ffn_gate_inp_shexp." in name:  # as llama.cpp's quantizer writes it back: a vector
            data = data.reshape(-1)
        # The converter keeps the convolution and the router in F32.
        matrix = data.ndim >= 2 and ".ssm_conv1d." not in name and ".ffn_gate_inp." not in name
        array = np.ascontiguousarray(data.numpy().astype(np.float16 if half and matrix else np.float32))
        if q8_0 and matrix and data.shape[-1] % 32 == 0:
            from gguf.quants import quantize

            kind = gguf.GGMLQuantizationType.Q8_0
            writer.add_tensor(name, quantize(array, kind), raw_dtype=kind)
        else:
            writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return target


def _converter_input(weights: dict[str, torch.Tensor], config: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """The tensors as the converter's modify_tensors sees them: Qwen3-Next's in_proj_qkvz under
    the name the tensor map gives attn_qkv, and each layer's experts stacked, one tensor per
    matrix ([experts, out, in]), as Qwen2MoeModel merges them."""
    out: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[int, torch.Tensor]] = {}
    for name, tensor in weights.items():
        head, dot, rest = name.partition(".mlp.experts.")
        if dot:  # model.layers.N.mlp.experts.E.gate_proj.weight
            expert, matrix = rest.split(".", 1)
            experts.setdefault(f"{head}.mlp.experts.{matrix}", {})[int(expert)] = tensor
        else:
            out[name.replace(".in_proj_qkvz.", ".in_proj_qkv.")] = tensor
    for name, each in experts.items():
        assert sorted(each) == list(range(config["num_experts"])), name
        out[name] = torch.stack([each[expert] for expert in range(len(each))])
    return out


def _expert_metadata(arch: str, config: Mapping[str, Any]) -> dict[str, Any]:
    """What the converter writes of a MoE's experts (TextModel's counts, Qwen2MoeModel's widths)."""
    if "num_experts" not in config:
        return {}
    return {
        f"{arch}.expert_count": config["num_experts"],
        f"{arch}.expert_used_count": config["num_experts_per_tok"],
        f"{arch}.expert_feed_forward_length": config["moe_intermediate_size"],
        f"{arch}.expert_shared_feed_forward_length": config["shared_expert_intermediate_size"],
    }


def _rope_sections(arch: str, rope: Mapping[str, Any], rotated: int) -> dict[str, Any]:
    """Qwen3.5's converters (_Qwen35MRopeMixin) write RoPE's sections; Qwen3-Next's does not."""
    if arch == "qwen3next":
        return {}
    return {f"{arch}.rope.dimension_sections": [*rope.get("mrope_section", _sections(rotated // 2)), 0]}


def _sections(pairs: int) -> list[int]:
    """Qwen3.5's mrope sections for a head turning `pairs` pairs ([11, 11, 10] for 32, the
    converter's default): llama.cpp's RoPE requires them to cover the pairs (a text's positions
    are one in every section, so how they split does not change its result)."""
    return [pairs - 2 * (pairs // 3), pairs // 3, pairs // 3]


def _gguf_type(value: Any) -> tuple[Any, ...]:
    """The type llama.cpp's converter gives such a value: u32 counts, f32 floats, i32 arrays."""
    from gguf import GGUFValueType as T

    if isinstance(value, list):
        return T.ARRAY, T.STRING if isinstance(value[0], str) else T.INT32
    kinds = {bool: T.BOOL, int: T.UINT32, float: T.FLOAT32, str: T.STRING}
    return (kinds[type(value)],)


def _tokenizer_metadata(folder: Path, config: Mapping[str, Any]) -> dict[str, Any]:
    """The folder's byte-level BPE tokenizer as llama.cpp's converter records one (its
    `_set_vocab_gpt2`): tokens by id, merges, types, special ids and the chat template."""
    tokenizer = json.loads((folder / "tokenizer.json").read_text())
    vocab = dict(tokenizer["model"]["vocab"])
    special = {token["id"] for token in tokenizer["added_tokens"] if token["special"]}
    vocab |= {token["content"]: token["id"] for token in tokenizer["added_tokens"]}
    tokens = [token for token, _ in sorted(vocab.items(), key=lambda item: item[1])]
    assert len(tokens) == config["vocab_size"]
    merges = [m if isinstance(m, str) else " ".join(m) for m in tokenizer["model"]["merges"]]
    template = (folder / "chat_template.jinja").read_text()
    return {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "gpt-2",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [CONTROL if i in special else NORMAL for i in range(len(tokens))],
        "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.eos_token_id": config["eos_token_id"],
        "tokenizer.ggml.bos_token_id": config["bos_token_id"],
        "tokenizer.ggml.padding_token_id": config["pad_token_id"],
        "tokenizer.ggml.add_bos_token": False,
        "tokenizer.chat_template": template,
    }
