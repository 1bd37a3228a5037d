"""How fast llmcli's compiled CPU kernels (src/csrc/) multiply GGUF blocks, each level side by
side, with torch's bf16 F.linear of the same shape as the baseline: y[m, n] = x[m, k] · W[n, k]ᵀ
at the shapes of the demo's layers, for a GEMV (m = 1, decode) and a small batch (m = 16).

Each cell is the median over several runs of many calls, in µs, with the spread of those runs
(max − min, as a share of the median); the GB/s column is the weight bytes the fastest level read
per second at m = 1. Weights are random, quantized by gguf's own quantizer where it has one, else
random blocks whose scales are set to a small ordinary half (timing does not depend on values).

  python setup.py build_ext --inplace && python scripts/bench_cpu_products.py [--threads 2] [TYPE ...]

Another type is one row of `TYPES`: its name in cpu_kernels.TYPE_IDS, the bytes and elements of
its block, and the byte offsets of the fp16 scales inside a block (for the random blocks).
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from llmcli.models import cpu_kernels


@dataclass(frozen=True)
class BlockType:
    block_elems: int
    block_bytes: int
    half_offsets: tuple[int, ...]  # where the block's fp16 scales (d, and m or dmin) sit


TYPES = {
    "Q4_0": BlockType(32, 18, (0,)),
    "Q4_1": BlockType(32, 20, (0, 2)),
    "Q5_0": BlockType(32, 22, (0,)),
    "Q5_1": BlockType(32, 24, (0, 2)),
    "Q8_0": BlockType(32, 34, (0,)),
    "IQ4_NL": BlockType(32, 18, (0,)),
    "Q4_K": BlockType(256, 144, (0, 2)),
    "Q5_K": BlockType(256, 176, (0, 2)),
    "Q6_K": BlockType(256, 210, (208,)),
    "Q2_K": BlockType(256, 84, (80, 82)),
    "Q3_K": BlockType(256, 110, (108,)),
    "IQ4_XS": BlockType(256, 136, (0,)),
    "F16": BlockType(1, 2, ()),
    "BF16": BlockType(1, 2, ()),
}
SHAPES = ((1024, 1024), (2816, 1024), (1024, 2816))  # (n, k): attention, gate/up, down
BATCHES = (1, 16)


def weight_blocks(type_name: str, n: int, k: int, rng: np.random.Generator) -> torch.Tensor:
    """n rows of k values in `type_name`'s blocks, as a file holds them."""
    import gguf

    kind = TYPES[type_name]
    values = rng.standard_normal((n, k)).astype(np.float32)
    try:
        blocks = gguf.quants.quantize(values, gguf.GGMLQuantizationType[type_name])
    except NotImplementedError:
        blocks = rng.integers(0, 256, (n, k // kind.block_elems, kind.block_bytes), dtype=np.uint8)
        for offset in kind.half_offsets:
            blocks[:, :, offset : offset + 2] = np.array([0.01], dtype=np.float16).view(np.uint8)
    return torch.from_numpy(np.ascontiguousarray(blocks).view(np.uint8).reshape(n, -1))  # F16 comes as fp16


# cpu: the process's own CPU time, which other work on a busy machine does not inflate; with
# --threads 1 it still ranks the levels and types against each other where wall time cannot.
CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


def timed_us(
    call: Callable[[], object], runs: int, seconds_per_run: float, clock: str = "wall"
) -> tuple[float, float]:
    """Median µs per call over `runs` runs, and the runs' spread (max − min) over the median."""
    now = CLOCKS[clock]
    call()
    start = now()
    call()
    calls = max(3, int(seconds_per_run / max(now() - start, 1e-7)))
    times = []
    for _ in range(runs):
        start = now()
        for _ in range(calls):
            call()
        times.append((now() - start) / calls * 1e6)
    median = statistics.median(times)
    return median, (max(times) - min(times)) / median


def cell(result: tuple[float, float]) -> str:
    median, spread = result
    return f"{median:8.1f} ±{spread * 100:3.0f}%"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("types", nargs="*", default=list(TYPES), help="types to time (default: all)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--seconds", type=float, default=0.05, help="time per run")
    parser.add_argument("--clock", choices=CLOCKS, default="wall", help="cpu: a busy machine's")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    levels = [level for level in cpu_kernels.built_levels() if cpu_kernels.runs_here(level)]
    loaded = {level: cpu_kernels._load(level) for level in levels}
    rng = np.random.default_rng(0)
    print(
        f"{args.threads} threads, {args.clock} clock; µs per call, median of {args.runs} runs ± their spread"
    )
    columns = " | ".join(f"{name:>14}" for name in [*levels, "torch bf16"])
    print(f"| {'type':6} | {'n×k':9} | {'m':>2} | {columns} | GB/s |")
    print("|" + "---|" * (len(levels) + 5))
    for n, k in SHAPES:
        for m in BATCHES:
            x = torch.from_numpy(rng.standard_normal((m, k)).astype(np.float32))
            dense = torch.from_numpy(rng.standard_normal((n, k)).astype(np.float32)).bfloat16()
            x16 = x.bfloat16()
            baseline = timed_us(functools.partial(F.linear, x16, dense), args.runs, args.seconds, args.clock)
            for type_name in args.types:
                blocks = weight_blocks(type_name, n, k, rng)
                calls = [functools.partial(each.matmul, x, blocks, type_name, n) for each in loaded.values()]
                results = [timed_us(call, args.runs, args.seconds, args.clock) for call in calls]
                rate = blocks.numel() / min(median for median, _ in results) / 1e3
                cells = " | ".join(cell(result) for result in [*results, baseline])
                print(f"| {type_name:6} | {n}×{k:<4} | {m:>2} | {cells} | {rate:4.1f} |")


if __name__ == "__main__":
    main()
