"""How fast llmcli's compiled CPU kernels (src/csrc/) multiply a GGUF type's blocks on this CPU,
every level this CPU runs side by side, against torch's bf16 dense `F.linear` of the same shape
(what llmcli ran before the kernels, and the bar each type's product should clear).

Each cell is the median of several runs (each run enough calls for ~40 ms) and, after ±, half
the spread between the fastest and the slowest run, in µs per product. The shapes are the demo's
width: a square projection, gate/up (2816×1024) and down (1024×2816); m = 1 is a decode step's
GEMV, m = 16 a short prefill's.

  python scripts/bench_cpu_products.py [--threads 2] [--runs 7] [--types F16,BF16] [--clock cpu]

Compare on a quiet machine only (load < 1.5); on a busy one, `--threads 1 --clock cpu` still
ranks the levels against each other (the process's own CPU time, one thread, no pool waits).
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from collections.abc import Callable

import gguf
import numpy as np
import torch
import torch.nn.functional as F

from llmcli.models import cpu_kernels

SHAPES = ((1024, 1024), (2816, 1024), (1024, 2816))  # (n output rows, k inputs)
BATCHES = (1, 16)
# Each type's block: (elements, bytes, byte offsets of its fp16 scales). Types gguf cannot
# quantize get random bytes with these scales made small, normal fp16 values (a random scale may
# be a NaN or a subnormal, which some CPUs multiply more slowly than the real thing).
TYPES: dict[str, tuple[int, int, tuple[int, ...]]] = {
    "F16": (1, 2, ()),
    "BF16": (1, 2, ()),
    "Q2_K": (256, 84, (80, 82)),
    "Q3_K": (256, 110, (108,)),
    "IQ4_XS": (256, 136, (0,)),
}


def weight_blocks(type_name: str, n: int, k: int, rng: np.random.Generator) -> torch.Tensor:
    """n rows of k elements in `type_name`'s blocks, as a uint8 tensor [n, row bytes]."""
    elements, size, scales = TYPES[type_name]
    quant_type = gguf.GGMLQuantizationType[type_name]
    try:
        values = rng.standard_normal((n, k)).astype(np.float32) * 0.02
        blocks = np.ascontiguousarray(gguf.quants.quantize(values, quant_type)).view(np.uint8)
    except NotImplementedError:
        blocks = rng.integers(0, 256, (n, k // elements, size), dtype=np.uint8)
        for offset in scales:
            scale = rng.uniform(1e-4, 1e-2, blocks.shape[:2]).astype(np.float16)
            blocks[:, :, offset : offset + 2] = scale.view(np.uint8).reshape(*scale.shape, 2)
    return torch.from_numpy(np.ascontiguousarray(blocks.reshape(n, -1)))


CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


def timed_us(fn: Callable[[], object], runs: int, clock: Callable[[], float]) -> tuple[float, float]:
    """Median and half-spread of `runs` runs, in µs per call."""
    fn()
    start = clock()
    fn()
    calls = max(1, int(0.04 / max(clock() - start, 1e-7)))
    times = []
    for _ in range(runs):
        start = clock()
        for _ in range(calls):
            fn()
        times.append((clock() - start) / calls * 1e6)
    return statistics.median(times), (max(times) - min(times)) / 2


def cell(result: tuple[float, float]) -> str:
    median, spread = result
    return f"{median:,.0f} ± {spread:,.0f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument(
        "--clock",
        choices=CLOCKS,
        default="wall",
        help="cpu: the process's CPU time, which other work on a busy machine does not inflate (--threads 1)",
    )
    parser.add_argument("--types", default=",".join(TYPES), help="comma-separated GGUF type names")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    levels = [level for level in cpu_kernels.built_levels() if cpu_kernels.runs_here(level)]
    loaded = {level: cpu_kernels._load(level) for level in levels}
    rng = np.random.default_rng(0)
    runs, clock = args.runs, CLOCKS[args.clock]
    print(f"{args.threads} threads, {args.clock} µs per product: median ± half the spread of {runs} runs\n")
    print("| type | n×k | m | torch bf16 | " + " | ".join(levels) + " |")
    print("|---|---|---:|---:|" + "---:|" * len(levels))
    for type_name in args.types.split(","):
        for n, k in SHAPES:
            blocks = weight_blocks(type_name, n, k, rng)
            dense = torch.randn(n, k).to(torch.bfloat16)
            for m in BATCHES:
                x = torch.randn(m, k)
                x_bf16 = x.to(torch.bfloat16)
                cells = [cell(timed_us(functools.partial(F.linear, x_bf16, dense), runs, clock))]
                for level in levels:
                    kernels = loaded[level]
                    if kernels is None or type_name not in kernels.types:
                        cells.append("—")
                        continue
                    product = functools.partial(kernels.matmul, x, blocks, type_name, n)
                    cells.append(cell(timed_us(product, runs, clock)))
                print(f"| {type_name} | {n}×{k} | {m} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
