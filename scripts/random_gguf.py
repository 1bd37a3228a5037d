"""A Llama GGUF file of a config's shapes in Q4_K_M's mix of types, its blocks random: what a
lease without downloads decodes to compare a K-quant file's speed with the same shapes in int4.

    python scripts/random_gguf.py --config configs/llama-3.1-8b.json --out /tmp/q4_k_m.gguf

gguf's Python package writes blocks but quantizes no K-quant (its Q4_K has no quantize), and
llama.cpp's llama-quantize is not on a lent GPU machine (only the repository travels), so the
blocks are random bytes with finite scales: speed does not depend on them. The types are
llama.cpp's Q4_K_M choice (llama_tensor_get_type): Q4_K everywhere but the output head and the
attn_v and ffn_down of the layers that get more bits (the first and last eighth, and every third
between), which are Q6_K; norms F32. The tokenizer is a byte-level BPE of the file's vocabulary
size (the 256 byte symbols, one merge, then "w0", "w1", …), as llmcli's reader of a "gpt2"
tokenizer takes one. Needs the gguf package (not on the GPU image: carry its wheel); without it
prints {"status": "not measured", "why": …} and exits 3.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

Q4_K_M = 15  # llama.cpp's LLAMA_FTYPE_MOSTLY_Q4_K_M (general.file_type)
# Per type: (values a block stands for, bytes a block takes, byte offsets of its fp16 scales) —
# llama.cpp's ggml-common.h (block_q8_0: d then qs; block_q4_K/q5_K: d, dmin first; block_q6_K:
# d last; block_iq4_xs: d first).
BLOCKS = {
    "Q4_K": (256, 144, (0, 2)),
    "Q5_K": (256, 176, (0, 2)),
    "Q6_K": (256, 210, (208,)),
    "Q8_0": (32, 34, (0,)),
    "IQ4_XS": (256, 136, (0,)),
}


def byte_symbols() -> list[str]:
    """GPT-2's 256 byte symbols, in byte order (its bytes_to_unicode)."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    extra = iter(range(256, 512))
    return [chr(b) if b in printable else chr(next(extra)) for b in range(256)]


def tokenizer_metadata(vocab_size: int) -> dict[str, Any]:
    symbols = byte_symbols()
    merged = "Ġt"  # one merge: llmcli's reader wants the list
    tokens = [*symbols, merged, *(f"w{index}" for index in range(vocab_size - len(symbols) - 2)), "<|eot|>"]
    return {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "llama-bpe",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [1] * (vocab_size - 1) + [3],
        "tokenizer.ggml.merges": ["Ġ t"],
        "tokenizer.ggml.eos_token_id": vocab_size - 1,
        "tokenizer.ggml.bos_token_id": vocab_size - 1,
        "tokenizer.ggml.add_bos_token": False,
    }


def random_blocks(type_name: str, rows: int, width: int, rng: np.random.Generator) -> np.ndarray:
    """uint8 [rows, bytes a row]: random codes, each fp16 scale between 2^-11 and 2^-10 (random
    bytes would make some scales NaN or infinite)."""
    values, nbytes, scales = BLOCKS[type_name]
    blocks = rng.integers(0, 256, (rows, width // values, nbytes), dtype=np.uint8)
    for offset in scales:
        blocks[..., offset + 1] = 0x10 | (blocks[..., offset + 1] & 0x03)
    return blocks.reshape(rows, -1)


def more_bits(layer: int, layers: int) -> bool:
    """llama.cpp's use_more_bits: the layers Q4_K_M gives Q6_K's attn_v and ffn_down."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def tensors(config: dict[str, Any]) -> list[tuple[str, str, tuple[int, int]]]:
    """(name, type, (rows, width)) of each matrix, as llama.cpp's converter names a Llama's."""
    hidden, layers = config["hidden_size"], config["num_hidden_layers"]
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    kv = config.get("num_key_value_heads") or heads
    inner = config["intermediate_size"]
    out = [("token_embd.weight", "Q4_K", (config["vocab_size"], hidden))]
    for layer in range(layers):
        bits = "Q6_K" if more_bits(layer, layers) else "Q4_K"
        out += [
            (f"blk.{layer}.attn_q.weight", "Q4_K", (heads * head_dim, hidden)),
            (f"blk.{layer}.attn_k.weight", "Q4_K", (kv * head_dim, hidden)),
            (f"blk.{layer}.attn_v.weight", bits, (kv * head_dim, hidden)),
            (f"blk.{layer}.attn_output.weight", "Q4_K", (hidden, heads * head_dim)),
            (f"blk.{layer}.ffn_gate.weight", "Q4_K", (inner, hidden)),
            (f"blk.{layer}.ffn_up.weight", "Q4_K", (inner, hidden)),
            (f"blk.{layer}.ffn_down.weight", bits, (hidden, inner)),
        ]
    if not config.get("tie_word_embeddings"):
        out.append(("output.weight", "Q6_K", (config["vocab_size"], hidden)))
    return out


def write(config: dict[str, Any], target: Path) -> None:
    import gguf

    hidden, layers = config["hidden_size"], config["num_hidden_layers"]
    heads = config["num_attention_heads"]
    writer = gguf.GGUFWriter(str(target), "llama")
    T = gguf.GGUFValueType
    values: dict[str, Any] = {
        "llama.context_length": (config["max_position_embeddings"], T.UINT32),
        "llama.embedding_length": (hidden, T.UINT32),
        "llama.block_count": (layers, T.UINT32),
        "llama.feed_forward_length": (config["intermediate_size"], T.UINT32),
        "llama.rope.dimension_count": (config.get("head_dim") or hidden // heads, T.UINT32),
        "llama.attention.head_count": (heads, T.UINT32),
        "llama.attention.head_count_kv": (config.get("num_key_value_heads") or heads, T.UINT32),
        "llama.attention.layer_norm_rms_epsilon": (config.get("rms_norm_eps", 1e-5), T.FLOAT32),
        "llama.rope.freq_base": (config.get("rope_theta", 500000.0), T.FLOAT32),
        "llama.vocab_size": (config["vocab_size"], T.UINT32),
        "general.file_type": (Q4_K_M, T.UINT32),
        "general.name": ("random Q4_K_M", T.STRING),
    }
    for key, (value, kind) in values.items():
        writer.add_key_value(key, value, kind)
    for key, value in tokenizer_metadata(config["vocab_size"]).items():
        if isinstance(value, list):
            sub = T.STRING if isinstance(value[0], str) else T.INT32
            writer.add_key_value(key, value, T.ARRAY, sub_type=sub)
        else:
            kinds = {bool: T.BOOL, int: T.UINT32, str: T.STRING}
            writer.add_key_value(key, value, kinds[type(value)])
    rng = np.random.default_rng(0)
    for name, type_name, (rows, width) in tensors(config):
        kind = gguf.GGMLQuantizationType[type_name]
        writer.add_tensor(name, random_blocks(type_name, rows, width, rng), raw_dtype=kind)
    ones = np.ones(hidden, dtype=np.float32)
    for layer in range(layers):
        writer.add_tensor(f"blk.{layer}.attn_norm.weight", ones)
        writer.add_tensor(f"blk.{layer}.ffn_norm.weight", ones)
    writer.add_tensor("output_norm.weight", ones)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="a Llama config.json: its shapes")
    parser.add_argument("--out", type=Path, required=True, help="the .gguf file to write")
    args = parser.parse_args()
    try:
        import gguf  # noqa: F401
    except ImportError:
        why = "the gguf package is not installed (carry its wheel: the GPU image has none)"
        print(json.dumps({"status": "not measured", "why": why}))
        sys.exit(3)
    write(json.loads(Path(args.config).read_text()), args.out)


if __name__ == "__main__":
    main()
