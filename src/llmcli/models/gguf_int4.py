"""GGUF 4-bit blocks read as int4 codes, never dequantized: how a Q4_0/Q4_1/Q4_K file stays exact.

A Q4_0 block is 32 weights sharing an fp16 scale d (w = d·(q − 8)); a Q4_1 block adds an fp16
min m (w = d·q + m). llmcli's int4 (models/quantized.py) is groups of weights along the input
with a float scale and zero point, w = (q − 8)·scale + zero: with groups of 32, scale = d and
zero = 0 (Q4_0) or m + 8·d (Q4_1) give the same weights from the same codes. Both formulas are one
exact product plus one rounded sum, so the dequantized weights are bit-equal in fp32 whenever
the zero point itself is exact in fp32 (every block of the demo file: checked at conversion).

The codes are written once beside a GGUF conversion (`int4/blocks.safetensors`) and read by the
load instead of requantizing the fp16 copy. Each tensor is kept only after checking it against
both references: gguf's own dequantization (bit-equal in fp32) and transformers' conversion of
the same file (equal in fp16; this is what pins the tensor name and the row order, which
transformers reverses for Llama's q and k).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

GROUP = 32  # weights per Q4_0/Q4_1 block
BLOCKS_FILE = "int4/blocks.safetensors"  # in a folder of its own: not one of the model's shards
# Bytes of a block: Q4_0/Q4_1, 32 weights: fp16 d (and fp16 m) + 16 bytes of nibbles; Q4_K, 256
# weights: fp16 d and dmin, 12 bytes of eight 6-bit scales and mins, 128 bytes of nibbles.
_BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q4_K": 144}
_BLOCK_WEIGHTS = {"Q4_0": GROUP, "Q4_1": GROUP, "Q4_K": 256}
_LAYER_NAMES = {  # GGUF's per-layer tensor names → the Llama family's module names
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def codes_of(data: np.ndarray, type_name: str, out_features: int, in_features: int) -> tuple[np.ndarray, ...]:
    """(codes uint8 [N, K] in 0…15, scale fp32 [N, K/32], zero fp32 [N, K/32]) of a Q4_0, Q4_1
    or Q4_K tensor's raw bytes, in llmcli's convention w = (q − 8)·scale + zero."""
    blocks = np.ascontiguousarray(data, dtype=np.uint8).reshape(
        out_features, in_features // _BLOCK_WEIGHTS[type_name], _BLOCK_BYTES[type_name]
    )
    if type_name == "Q4_K":
        return _q4_k_codes(blocks, out_features, in_features)
    scale = blocks[..., 0:2].copy().view("<f2")[..., 0].astype(np.float32)
    if type_name == "Q4_1":
        zero = blocks[..., 2:4].copy().view("<f2")[..., 0].astype(np.float32) + np.float32(8) * scale
        nibbles = blocks[..., 4:]
    else:
        zero = np.zeros_like(scale)
        nibbles = blocks[..., 2:]
    # Byte j of a block holds element j in its low nibble and element 16 + j in its high one.
    codes = np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=-1).reshape(out_features, in_features)
    return codes, scale, zero


def _q4_k_codes(blocks: np.ndarray, out_features: int, in_features: int) -> tuple[np.ndarray, ...]:
    """A Q4_K super-block is 8 groups of 32 weights, group g: w = (d·sc_g)·q − dmin·m_g with 6-bit
    sc_g and m_g (as gguf dequantizes it). So scale = d·sc_g and zero = 8·scale − dmin·m_g: both
    products are exact in fp32, and the weights are bit-equal wherever that zero is too."""
    from gguf.quants import Q4_K

    rows = blocks.reshape(-1, blocks.shape[-1])
    d = rows[:, 0:2].copy().view("<f2").astype(np.float32)
    dmin = rows[:, 2:4].copy().view("<f2").astype(np.float32)
    sc, m = Q4_K.get_scale_min(np.ascontiguousarray(rows[:, 4:16]))
    scale = d * sc.astype(np.float32)
    zero = np.float32(8) * scale - dmin * m.astype(np.float32)
    # 32 bytes per pair of groups: the first group in their low nibbles, the second in the high.
    nibbles = rows[:, 16:].reshape(-1, 4, 1, 32)
    codes = np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=2).reshape(out_features, in_features)
    groups = in_features // GROUP
    return codes, scale.reshape(out_features, groups), zero.reshape(out_features, groups)


def dequantize(codes: Any, scale: Any, zero: Any) -> Any:
    """(q − 8)·scale + zero in fp32 as torch tensors, a product then a sum (no fused multiply-add,
    like gguf's reference): the weights the codes stand for."""
    import torch

    out_features, in_features = codes.shape
    q = codes.to(torch.float32).view(out_features, -1, GROUP) - 8
    product = q * scale.to(torch.float32)[..., None]
    return (product + zero.to(torch.float32)[..., None]).view(out_features, in_features)


def unpermute_rows(array: Any, heads: int) -> Any:
    """llama.cpp's converter interleaves the two rotary halves of each q/k head; transformers undoes
    it on load, so the codes must follow the same rows. A numpy array or a torch tensor (a view
    where it can be)."""
    half = array.shape[0] // heads // 2
    return array.reshape(heads, half, 2, *array.shape[1:]).swapaxes(1, 2).reshape(array.shape)


def write_blocks(gguf_file: Path, folder: Path) -> int:
    """Write the codes of every Q4_0/Q4_1 layer weight of `gguf_file` that matches the conversion
    in `folder` to its BLOCKS_FILE. Returns how many tensors were written."""
    import json

    import torch
    from gguf import GGUFReader
    from gguf.quants import dequantize as gguf_dequantize
    from safetensors import safe_open
    from safetensors.torch import save_file

    config = json.loads((folder / "config.json").read_text())
    heads = {
        "q_proj": config["num_attention_heads"],
        "k_proj": config.get("num_key_value_heads") or config["num_attention_heads"],
    }
    converted = {}
    for shard in sorted(folder.glob("*.safetensors")):
        handle = safe_open(str(shard), framework="pt")
        converted.update(dict.fromkeys(handle.keys(), handle))
    tensors: dict[str, torch.Tensor] = {}
    for tensor, name in _layer_tensors(GGUFReader(str(gguf_file))):
        type_name = tensor.tensor_type.name
        handle = converted.get(name + ".weight")
        if type_name not in _BLOCK_BYTES or handle is None:
            continue
        reference = handle.get_tensor(name + ".weight")
        if reference.dim() != 2 or reference.shape[1] % GROUP or tensor.n_elements != reference.numel():
            continue
        out_features, in_features = reference.shape
        codes, scale, zero = codes_of(tensor.data, type_name, out_features, in_features)
        exact = gguf_dequantize(tensor.data, tensor.tensor_type).reshape(out_features, in_features)
        projection = name.rsplit(".", 1)[-1]
        orders = [None] + ([heads[projection]] if projection in heads else [])
        for rotary_heads in orders:  # as stored, or with llama's q/k rows undone
            rows = _identity if rotary_heads is None else _unpermuter(rotary_heads)
            candidate = [torch.from_numpy(np.ascontiguousarray(rows(a))) for a in (codes, scale, zero)]
            weights = dequantize(*candidate)
            if not torch.equal(weights, torch.from_numpy(np.ascontiguousarray(rows(exact)))):
                break  # not bit-equal to gguf's own dequantization: this tensor is requantized instead
            if torch.equal(weights.to(reference.dtype), reference):
                tensors[f"{name}.codes"] = (candidate[0][:, ::2] | candidate[0][:, 1::2] << 4).contiguous()
                tensors[f"{name}.scale"], tensors[f"{name}.zero"] = candidate[1], candidate[2]
                break
    # Atomic: another llmcli loading this model at the same time reads a whole file or none.
    target = folder / BLOCKS_FILE
    target.parent.mkdir(exist_ok=True)
    staging = target.with_name(f".{target.name}.{os.getpid()}")
    save_file(tensors, str(staging))
    os.replace(staging, target)
    return len(tensors) // 3


def _identity(array: np.ndarray) -> np.ndarray:
    return array


def _unpermuter(heads: int) -> Callable[[np.ndarray], np.ndarray]:
    return lambda array: unpermute_rows(array, heads)


def _layer_tensors(reader: Any) -> Iterator[tuple[Any, str]]:
    for tensor in reader.tensors:
        parts = tensor.name.split(".")  # blk.N.attn_q.weight
        if len(parts) == 4 and parts[0] == "blk" and parts[2] in _LAYER_NAMES and parts[3] == "weight":
            yield tensor, f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}"


class Int4Blocks:
    """The codes written beside a conversion, by module name (model.layers.0.self_attn.q_proj)."""

    group = GROUP
    wider: frozenset[str] = frozenset()  # a conversion's other layers go to the model's kind, as ever

    def __init__(self, path: Path) -> None:
        from llmcli.models.tensor_file import TensorFile

        self._file = TensorFile(path)  # read layer by layer: a mapping would keep all of it resident
        self._names = {key.rsplit(".", 1)[0] for key in self._file.keys()}  # noqa: SIM118

    def __contains__(self, name: str) -> bool:
        return name in self._names

    def __len__(self) -> int:
        return len(self._names)

    @property
    def names(self) -> frozenset[str]:
        return frozenset(self._names)

    def block_type(self, name: str) -> None:
        """A conversion keeps no file blocks for the compiled kernels to multiply."""
        return None

    def blocks(self, name: str) -> None:
        return None

    def int8(self, name: str, scale_dtype: Any) -> None:
        """A conversion's other layers are read as floats from its safetensors."""
        return None

    def get(self, name: str) -> tuple[Any, Any, Any]:
        """(codes int32 [N, K] in 0…15, scale fp32 [N, K/32], zero fp32 [N, K/32])."""
        import torch

        packed = self._file.get(f"{name}.codes")
        codes = torch.stack([packed & 0x0F, packed >> 4], dim=-1).view(packed.shape[0], -1).to(torch.int32)
        return codes, self._file.get(f"{name}.scale"), self._file.get(f"{name}.zero")


def blocks_of(folder: Path) -> Int4Blocks | None:
    path = folder / BLOCKS_FILE
    return Int4Blocks(path) if path.is_file() else None
