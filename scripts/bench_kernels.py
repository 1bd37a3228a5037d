"""Batch-1 GEMV kernels on the GPU, per layer shape of Llama-3.1-8B: bf16 (cuBLAS), int8 (llmcli's
Triton GEMV at several block sizes, and the dequantize-then-matmul fallback) and int4 (tinygemm,
group 128). Each kernel is timed as 20 launches inside one CUDA graph (median of 7 replays), and
reported as µs per call and the share of measured memory bandwidth its weights' bytes come to.

    python scripts/bench_kernels.py
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from llmcli.engine.bench import measure_bandwidth
from llmcli.models import int8_cuda
from llmcli.models.quantized import QuantizedLinear

SHAPES = {  # (out, in)
    "qkv 6144×4096": (6144, 4096),
    "o 4096×4096": (4096, 4096),
    "gate_up 28672×4096": (28672, 4096),
    "down 4096×14336": (4096, 14336),
    "head 128256×4096": (128256, 4096),
    "1B o 2048×2048": (2048, 2048),
    "1B gate_up 16384×2048": (16384, 2048),
    "1B down 2048×8192": (2048, 8192),
}
CONFIGS = [(4, 512, 4), (8, 512, 4), (16, 512, 4), (8, 256, 4), (16, 256, 8), (32, 256, 8), (8, 1024, 8)]
CALLS = 20


def graph_time(fn: Callable[[], object]) -> float:
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(CALLS):
            fn()
    times = []
    for _ in range(7):
        torch.cuda.synchronize()
        start = time.perf_counter()
        graph.replay()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) / CALLS)
    return statistics.median(times)


def main() -> None:
    device = torch.device("cuda")
    bandwidth = measure_bandwidth(device) * 1e9
    print(f"measured bandwidth {bandwidth / 1e9:.0f} GB/s; µs per call (% of bandwidth)\n")
    header = ["shape", "bf16", "int8 dequant", *[f"int8 {n}/{k}/{w}" for n, k, w in CONFIGS], "int4 g128"]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for name, (n, k) in SHAPES.items():
        print(f"| {name} | " + " | ".join(shape_row(n, k, bandwidth)))


def shape_row(n: int, k: int, bandwidth: float) -> list[str]:
    device = torch.device("cuda")
    weight = torch.randn(n, k, device=device, dtype=torch.bfloat16) * 0.02
    x = torch.randn(1, k, device=device, dtype=torch.bfloat16)
    int8 = QuantizedLinear.int8(weight, None)
    int4 = QuantizedLinear.int4(weight, None, 128)
    kernel = int8_cuda._kernel()

    def cell(fn: Callable[[], object], weight_bytes: float) -> str:
        seconds = graph_time(fn)
        return f"{seconds * 1e6:.1f} ({100 * weight_bytes / seconds / bandwidth:.0f} %)"

    def triton_gemv(block_n: int, block_k: int, warps: int) -> Callable[[], object]:
        out = torch.empty(1, n, dtype=x.dtype, device=device)
        grid = (-(-n // block_n), 1)
        return lambda: kernel[grid](
            x, int8.packed, int8.scales, out, n, k, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps
        )

    cells = [cell(lambda: F.linear(x, weight), n * k * 2)]
    cells.append(cell(lambda: F.linear(x, int8.packed.to(x.dtype)) * int8.scales, n * k))
    cells += [cell(triton_gemv(*config), n * k) for config in CONFIGS]
    cells.append(cell(lambda: int4(x), n * k / 2))
    reference = x.float() @ int8.dequantized().t()
    error = ((int8(x).float() - reference).norm() / reference.norm()).item()
    return [*cells, f" (int8 relative error {error:.1e}) |"]


if __name__ == "__main__":
    main()
