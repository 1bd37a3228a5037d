"""GGUF block kernels on the GPU (models/gguf_cuda.py), per type, on Llama-3.1-8B's layer shapes:
the GEMV at batch 1 as µs per call and the share of measured copy bandwidth its bytes (blocks,
input, output) come to, over a few program shapes (BLOCK_N channels × warps); then, for Q4_K, the
rows at which dequantizing and one torch matmul overtakes the GEMV (gguf_cuda.GEMV_MAX_ROWS);
int4 (tinygemm, group 32: the GGUF int4 path) and bf16 (cuBLAS) beside it. Issue 45's target:
each type ≥ 70 % of copy bandwidth. Each kernel is timed as 20 launches inside one CUDA graph
(bench_kernels.graph_time).

    python scripts/bench_gguf_cuda.py            # every type; --types Q4_K,Q6_K for some
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch
import torch.nn.functional as F

from bench_kernels import graph_time
from llmcli.engine.bench import measure_bandwidth
from llmcli.models import gguf_cuda
from llmcli.models.gguf_finite import BLOCK_SCALES
from llmcli.models.quantized import QuantizedLinear

SHAPES = {  # (out, in)
    "4096×4096": (4096, 4096),
    "14336×4096": (14336, 4096),
    "4096×14336": (4096, 14336),
}
CONFIGS = [(4, 4), (8, 4), (16, 8), (32, 8)]  # (BLOCK_N, warps): 16 × 8 is gguf_cuda's choice
CROSSOVER_ROWS = [1, 2, 4, 8, 12, 16, 32]


def random_blocks(type_name: str, n: int, k: int) -> torch.Tensor:
    """Random blocks on the GPU, every fp16 scale made finite (its exponent's top bit cleared)."""
    nbytes, scales = BLOCK_SCALES[type_name]
    values = 32 if type_name in ("Q8_0", "Q4_0") else 256
    blocks = torch.randint(0, 256, (n * k // values, nbytes), dtype=torch.uint8, device="cuda")
    for offset, _ in scales:
        blocks[:, offset + 1] &= 0xBF
    return blocks.view(n, -1)


def cell(fn: Callable[[], object], nbytes: float, bandwidth: float) -> str:
    seconds = graph_time(fn)
    return f"{seconds * 1e6:.1f} ({100 * nbytes / seconds / bandwidth:.0f} %)"


def main() -> None:
    parser = argparse.ArgumentParser(description="GGUF block kernels on the GPU, per type, on 8B's shapes")
    parser.add_argument("--types", default=",".join(sorted(gguf_cuda.TYPES)))
    types = parser.parse_args().types.split(",")
    device = torch.device("cuda")
    bandwidth = measure_bandwidth(device) * 1e9
    print(
        f"{torch.cuda.get_device_name()}: copy bandwidth {bandwidth / 1e9:.0f} GB/s; µs per call (% of it)\n"
    )
    header = ["type", "shape", *[f"GEMV {n}/{w}" for n, w in CONFIGS], "int4 g32", "bf16"]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for type_name in types:
        for name, (n, k) in SHAPES.items():
            print(
                f"| {type_name} | {name} | " + " | ".join(gemv_row(type_name, n, k, bandwidth)) + " |",
                flush=True,
            )
    print("\nQ4_K 4096×4096, µs: the GEMV against dequantizing + one matmul, by rows (bf16)\n")
    print("| rows | GEMV | dequantize + matmul |\n|---|---|---|")
    blocks = random_blocks("Q4_K", 4096, 4096)
    for rows in CROSSOVER_ROWS:
        x = torch.randn(rows, 4096, device=device, dtype=torch.bfloat16)
        gemv = graph_time(lambda x=x: gguf_cuda.gemv(x, blocks, "Q4_K", 4096))
        dense = graph_time(lambda x=x: F.linear(x, gguf_cuda.dequantize(blocks, "Q4_K", 4096, x.dtype)))
        print(f"| {rows} | {gemv * 1e6:.1f} | {dense * 1e6:.1f} |", flush=True)


def gemv_row(type_name: str, n: int, k: int, bandwidth: float) -> list[str]:
    device = torch.device("cuda")
    blocks = random_blocks(type_name, n, k)
    x = torch.randn(1, k, device=device, dtype=torch.bfloat16)
    moved = blocks.numel() + 2 * (k + n)  # the blocks, the input and the output
    cells = [
        cell(lambda n=block_n, w=warps: gguf_cuda.gemv(x, blocks, type_name, k, n, w), moved, bandwidth)
        for block_n, warps in CONFIGS
    ]
    weight = gguf_cuda.dequantize(blocks, type_name, k, torch.bfloat16)
    reference = x.float() @ weight.float().t()
    error = ((gguf_cuda.matmul(x, blocks, type_name, k).float() - reference).norm() / reference.norm()).item()
    assert error < 1e-2, f"{type_name} GEMV off by {error:.1e}"
    int4 = QuantizedLinear.int4(weight, None, 32)
    cells.append(cell(lambda: int4(x), n * k / 2 + n * k / 32 * 4, bandwidth))
    cells.append(cell(lambda: F.linear(x, weight), n * k * 2, bandwidth))
    return cells


if __name__ == "__main__":
    main()
