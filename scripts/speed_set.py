"""A speed set of GGUF files at the demo's scale where every K-quant is real: one random Llama of
width 1024 (8 layers, 16 heads, 4 KV heads, intermediate 2816, the demo's tokenizer and tied
embeddings, so the output head weighs what the demo's does), written by gguf's own writer and
quantized to each type by llama.cpp's own `llama-quantize`.

The demo's width (576) is not a multiple of 256, so llama.cpp falls back to Q5_0/Q8_0 for most of
its tensors under a K-quant name; every width here is a multiple of 256, so each file holds the
blocks its name says. The weights are random but "peaked" (fan-in scaled projections, logits with
a standard deviation near 3, as the GGUF fixtures' are), so perplexity moves with the arithmetic
instead of sitting at the vocabulary's size.

Made once into a cache folder outside the repository (each file written under a temporary name
and renamed, so an interrupted run leaves nothing half-made behind):

  python scripts/speed_set.py [--dir /tmp/llmcli-speed-set] [--types Q4_0,Q4_K_M]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from gguf_files import rewrite_gguf

DEFAULT_DIR = Path(tempfile.gettempdir()) / "llmcli-speed-set"
LLAMA_CPP = Path(__file__).resolve().parents[2] / "shared" / "llama.cpp"
# llama-quantize's names; F16 is the source every other type is quantized from, as llama.cpp's
# converter's output would be.
TYPES = (
    "F16", "BF16", "Q8_0", "Q6_K", "Q5_K_M", "Q5_1", "Q5_0", "Q4_K_M", "Q4_1", "Q4_0",
    "IQ4_XS", "IQ4_NL", "Q3_K_M", "Q2_K",
)  # fmt: skip
SHAPE = {"width": 1024, "layers": 8, "heads": 16, "kv_heads": 4, "intermediate": 2816}
STEM = "speed-llama-w1024-l8"


def speed_file(folder: Path, type_name: str) -> Path:
    return folder / f"{STEM}.{type_name}.gguf"


def make_speed_set(folder: Path, types: list[str], llama_cpp: Path = LLAMA_CPP) -> list[Path]:
    """The files of `types` in `folder`, made where missing; F16 first, the others from it."""
    unknown = [name for name in types if name not in TYPES]
    if unknown:
        raise SystemExit(f"unknown type(s) {', '.join(unknown)}: choose from {', '.join(TYPES)}")
    quantize = llama_cpp / "llama-quantize"
    folder.mkdir(parents=True, exist_ok=True)
    f16 = speed_file(folder, "F16")
    missing = [name for name in types if not speed_file(folder, name).is_file()]
    if missing and not quantize.is_file():
        raise SystemExit(f"{quantize} not found: it makes the speed set ({', '.join(missing)} missing)")
    if missing and not f16.is_file():
        source = folder / f"{STEM}.F32.partial"
        write_random_llama(source)
        _quantize(quantize, source, f16, "F16")
        source.unlink()
    for name in missing:
        if name != "F16":
            print(f"making {speed_file(folder, name).name}", file=sys.stderr)
            _quantize(quantize, f16, speed_file(folder, name), name)
    return [speed_file(folder, name) for name in types]


def _quantize(quantize: Path, source: Path, target: Path, type_name: str) -> None:
    staging = target.with_suffix(".partial")
    done = subprocess.run(
        [str(quantize), str(source), str(staging), type_name, "2"], capture_output=True, text=True
    )
    if done.returncode != 0 or not staging.is_file():
        tail = (done.stderr or done.stdout).strip().splitlines()[-1:]
        raise SystemExit(f"llama-quantize could not make {target.name}: {' '.join(tail)}")
    staging.rename(target)


def write_random_llama(target: Path, seed: int = 7) -> Path:
    """The random Llama in fp32, its metadata (tokenizer and chat template included) the demo's
    with the shape above."""
    from llmcli.models.resolve import demo_gguf_path

    width, layers, heads = SHAPE["width"], SHAPE["layers"], SHAPE["heads"]
    head_dim, kv_width = width // heads, SHAPE["kv_heads"] * (width // heads)
    demo = demo_gguf_path()
    vocab = _vocab_size(demo)
    rng = np.random.default_rng(seed)

    def projection(rows: int, columns: int) -> np.ndarray:
        return (rng.standard_normal((rows, columns), dtype=np.float32) / np.sqrt(columns)).astype(np.float32)

    ones = np.ones(width, dtype=np.float32)
    # Tied: the embedding is the output head too; 3/sqrt(width) gives normed states logits of std ~3.
    tensors = {
        "token_embd.weight": rng.standard_normal((vocab, width), dtype=np.float32) * (3 / np.sqrt(width)),
        "output_norm.weight": ones,
    }
    for layer in range(layers):
        block = f"blk.{layer}."
        tensors |= {
            block + "attn_norm.weight": ones,
            block + "attn_q.weight": projection(width, width),
            block + "attn_k.weight": projection(kv_width, width),
            block + "attn_v.weight": projection(kv_width, width),
            block + "attn_output.weight": projection(width, width),
            block + "ffn_norm.weight": ones,
            block + "ffn_gate.weight": projection(SHAPE["intermediate"], width),
            block + "ffn_up.weight": projection(SHAPE["intermediate"], width),
            block + "ffn_down.weight": projection(width, SHAPE["intermediate"]),
        }
    metadata = {
        "general.name": "llmcli speed set (random)",
        "general.file_type": 0,  # all F32
        "llama.block_count": layers,
        "llama.embedding_length": width,
        "llama.feed_forward_length": SHAPE["intermediate"],
        "llama.attention.head_count": heads,
        "llama.attention.head_count_kv": SHAPE["kv_heads"],
        "llama.rope.dimension_count": head_dim,
    }
    return rewrite_gguf(demo, target, metadata=metadata, add=tensors, keep=lambda name: False)


def _vocab_size(path: Path) -> int:
    import gguf

    reader = gguf.GGUFReader(str(path))
    return len(reader.fields["tokenizer.ggml.tokens"].data)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--dir", type=Path, default=DEFAULT_DIR)
    parser.add_argument("--types", default=",".join(TYPES), help="comma-separated llama-quantize types")
    parser.add_argument("--llama-cpp", type=Path, default=LLAMA_CPP, help="the folder of llama-quantize")
    args = parser.parse_args()
    for path in make_speed_set(args.dir, args.types.split(","), args.llama_cpp):
        print(f"{path}  {path.stat().st_size / 1e6:.1f} MB")


if __name__ == "__main__":
    main()
