"""How a GEMV over GGUF-style blocks (int8 codes, one fp32 scale per 32 weights: Q8_0's layout,
which IQ4_NL, Q5_0 and Q6_K also map onto exactly) runs on this CPU without a compiler: numba's
JIT against torch's own kernels for the formats llmcli holds (fp16 dense, int8 per channel,
int4 groups of 32). This is the measurement behind reading those types into int8 rather than
computing on the file's blocks (models/gguf_direct.py). Median of 7 runs of 200 calls, in µs.

  pip install numba && python scripts/bench_gguf_kernels.py

numba is not a dependency of llmcli; without it the numba columns are left out.
"""

from __future__ import annotations

import importlib.util
import statistics
import time
from collections.abc import Callable

import numpy as np
import torch

SHAPES = ((1536, 576), (576, 1536), (4096, 4096))  # the demo's gate/up and down; an 8B-sized one


def median_us(fn: Callable[[], object], calls: int = 200, runs: int = 7) -> float:
    fn()
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(times)


def numba_kernels() -> dict[str, Callable[..., None]]:
    from numba import njit, prange

    @njit(fastmath=True, cache=True)
    def serial(q, d, x, out):
        n, k = q.shape
        for r in range(n):
            s = 0.0
            for j in range(k):  # one flat loop: LLVM vectorises it, gathering the block's scale
                s += q[r, j] * x[j] * d[r, j >> 5]
            out[r] = s

    @njit(parallel=True, fastmath=True, cache=True)
    def parallel(q, d, x, out):
        n, k = q.shape
        for r in prange(n):
            s = 0.0
            for j in range(k):
                s += q[r, j] * x[j] * d[r, j >> 5]
            out[r] = s

    return {"numba serial": serial, "numba parallel": parallel}


def measure(n: int, k: int, kernels: dict[str, Callable[..., None]]) -> list[float]:
    q = np.random.randint(-127, 128, (n, k), dtype=np.int8)
    d = (np.random.rand(n, k // 32) * 0.01).astype(np.float32)
    x = np.random.randn(k).astype(np.float32)
    out = np.empty(n, np.float32)
    expected = (q.astype(np.float32).reshape(n, -1, 32) * d[..., None]).reshape(n, k) @ x
    cells = []
    for kernel in kernels.values():
        kernel(q, d, x, out)
        assert np.allclose(out, expected, rtol=1e-3, atol=1e-3 * np.abs(expected).max())
        cells.append(median_us(lambda kernel=kernel: kernel(q, d, x, out)))
    dense = torch.randn(n, k, dtype=torch.float16)
    x16 = torch.randn(1, k, dtype=torch.float16)
    cells.append(median_us(lambda: torch.nn.functional.linear(x16, dense)))
    codes = torch.from_numpy(q)
    xb = torch.randn(1, k, dtype=torch.bfloat16)
    scales = torch.ones(n, dtype=torch.bfloat16)
    cells.append(median_us(lambda: torch.ops.aten._weight_int8pack_mm(xb, codes, scales)))
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
        torch.randint(0, 16, (n, k), dtype=torch.int32), 1
    )
    scales_zeros = torch.ones(k // 32, n, 2, dtype=torch.bfloat16)
    cells.append(median_us(lambda: torch.ops.aten._weight_int4pack_mm_for_cpu(xb, packed, 32, scales_zeros)))
    return cells


def main() -> None:
    kernels = numba_kernels() if importlib.util.find_spec("numba") else {}
    names = [*kernels, "torch fp16 dense", "torch int8 per channel", "torch int4 g32 (bf16)"]
    print(f"{torch.get_num_threads()} threads · median µs per call")
    print("| shape | " + " | ".join(names) + " |")
    print("|---|" + "---:|" * len(names))
    for n, k in SHAPES:
        cells = measure(n, k, kernels)
        print(f"| {n}×{k} | " + " | ".join(f"{c:.1f}" for c in cells) + " |")


if __name__ == "__main__":
    main()
