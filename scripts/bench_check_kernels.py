"""What a speculative check's rows cost in each linear-layer kernel on the GPU, per Llama-3.1-8B
layer shape: bf16 (cuBLAS), int8 (llmcli's GEMV, then its few-rows kernel), int4 (llmcli's Triton
kernel, int4_cuda.py) and int4 (torch's tinygemm, which the check pass outgrew: 3.0× a step at 16
rows, docs/benchmarks.md). µs per call for 1, 2, 4, 8 and 16 rows (bench_kernels.graph_time: 20
launches in one CUDA graph, median of 7 replays), and 16 rows against one.

    python scripts/bench_check_kernels.py
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch
import torch.nn.functional as F

from bench_kernels import SHAPES, graph_time
from llmcli.models.quantized import QuantizedLinear

ROWS = (1, 2, 4, 8, 16)


def layers(weight: torch.Tensor) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    os.environ["LLMCLI_INT4_CUDA"] = "triton"
    int4 = QuantizedLinear.int4(weight, None, 128)
    os.environ["LLMCLI_INT4_CUDA"] = "tinygemm"
    tinygemm = QuantizedLinear.int4(weight, None, 128)
    return {
        "bf16": lambda x: F.linear(x, weight),
        "int8": QuantizedLinear.int8(weight, None),
        "int4 triton": int4,
        "int4 tinygemm": tinygemm,
    }


def main() -> None:
    device = torch.device("cuda")
    print("µs per call by rows; last column: 16 rows against 1\n")
    print("| shape | kernel | " + " | ".join(f"{rows} rows" for rows in ROWS) + " | 16 / 1 |")
    print("|---|---|" + "---:|" * (len(ROWS) + 1))
    for name, (n, k) in SHAPES.items():
        if n > 30000:
            continue  # the head: int8 in every format, checked by bench_kernels.py
        weight = torch.randn(n, k, device=device, dtype=torch.bfloat16) * 0.02
        for kernel, layer in layers(weight).items():
            times = []
            for rows in ROWS:
                x = torch.randn(rows, k, device=device, dtype=torch.bfloat16)
                times.append(graph_time(lambda layer=layer, x=x: layer(x)) * 1e6)
            cells = " | ".join(f"{t:.1f}" for t in times)
            print(f"| {name} | {kernel} | {cells} | {times[-1] / times[0]:.2f}× |", flush=True)
        del weight
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
