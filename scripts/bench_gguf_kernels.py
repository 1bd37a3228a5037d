"""How a GEMV over GGUF-style blocks (int8 codes, one fp32 scale per 32 weights: Q8_0's layout,
which IQ4_NL, Q5_0 and Q6_K also map onto exactly) runs on this CPU without a compiler: numba's
JIT against torch's own kernels for the formats llmcli holds (fp16 dense, int8 per channel,
int4 groups of 32). This is the measurement behind reading those types into int8 rather than
computing on the file's blocks (models/gguf_direct.py). Median of 7 runs of 200 calls, in µs.

A second numba kernel computes as llama.cpp does: the activations quantized to int8 per block of
32 and each block's dot product in integers, one scale product per block.

A second table puts the other CPU kernels torch ships beside the two llmcli runs: fbgemm's fp16
GEMM (fp32 activations, weights packed; what an F16 file could run on), oneDNN's prepacked bf16
and fp16 products, fbgemm's int8 with activations quantized per tensor on the fly, and int8 × int8
(`torch._int_mm`), with the bytes fbgemm's packed fp16 matrix holds against the fp16 one.

  pip install numba && python scripts/bench_gguf_kernels.py

numba is not a dependency of llmcli; without it the numba columns are left out.
"""

from __future__ import annotations

import importlib.util
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

import numpy as np
import torch

SHAPES = ((1536, 576), (576, 1536), (4096, 4096))  # the demo's gate/up and down; an 8B-sized one
# The demo's q/k/v, o, gate/up, down and output head as llmcli runs them (fused), and an 8B-sized one.
TORCH_SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536), (49152, 576), (4096, 4096))


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

    @njit(parallel=True, fastmath=True, cache=True)
    def blocks_in_integers(q, d, x, out):
        n, k = q.shape
        blocks = k >> 5
        xq = np.empty(k, np.int8)  # the activations as llama.cpp quantizes them: Q8_0
        xd = np.empty(blocks, np.float32)
        for b in range(blocks):
            top = np.float32(0.0)
            for j in range(32):
                top = max(top, abs(x[b * 32 + j]))
            xd[b] = top / 127
            scale = 127 / top if top > 0 else np.float32(0.0)
            for j in range(32):
                xq[b * 32 + j] = np.int8(round(x[b * 32 + j] * scale))
        for r in prange(n):
            s = np.float32(0.0)
            for b in range(blocks):
                dot = np.int32(0)
                for j in range(32):
                    dot += np.int32(q[r, b * 32 + j]) * np.int32(xq[b * 32 + j])
                s += d[r, b] * xd[b] * np.float32(dot)
            out[r] = s

    return {
        "numba serial": serial,
        "numba parallel": parallel,
        "numba q8×q8, as llama.cpp": blocks_in_integers,
    }


def measure(n: int, k: int, kernels: dict[str, Callable[..., None]]) -> list[float]:
    q = np.random.randint(-127, 128, (n, k), dtype=np.int8)
    d = (np.random.rand(n, k // 32) * 0.01).astype(np.float32)
    x = np.random.randn(k).astype(np.float32)
    out = np.empty(n, np.float32)
    expected = (q.astype(np.float32).reshape(n, -1, 32) * d[..., None]).reshape(n, k) @ x
    cells = []
    for name, kernel in kernels.items():
        kernel(q, d, x, out)
        tolerance = 2e-2 if "q8×q8" in name else 1e-3  # activations rounded to 8 bits there
        assert np.allclose(out, expected, rtol=tolerance, atol=tolerance * np.abs(expected).max())
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


def torch_kernels(n: int, k: int) -> dict[str, Callable[[], object]]:
    """Each of torch's CPU products for an [n, k] layer at batch 1, ready to call."""
    weight = torch.randn(n, k) * 0.02
    half, x = weight.half(), torch.randn(1, k)
    x16, xb, brain = x.half(), x.bfloat16(), weight.bfloat16()
    codes = (weight / (weight.abs().amax(1, keepdim=True) / 127)).round().to(torch.int8)
    scales = torch.ones(n)
    fp16_packed = torch.ops.quantized.linear_prepack_fp16(half.float(), None)
    onednn_bf16 = torch.ops.mkldnn._reorder_linear_weight(brain, 1)
    onednn_fp16 = torch.ops.mkldnn._reorder_linear_weight(half, 1)
    per_channel = torch.quantize_per_channel(
        weight, scales.double(), torch.zeros(n, dtype=torch.long), 0, torch.qint8
    )
    int8_packed = torch.ops.quantized.linear_prepack(per_channel, None)
    x8 = torch.randint(-127, 128, (1, k), dtype=torch.int8)
    codes_t = codes.t()
    return {
        "aten fp16": lambda: torch.nn.functional.linear(x16, half),
        "fbgemm fp16 (fp32 in)": lambda: torch.ops.quantized.linear_dynamic_fp16(x, fp16_packed),
        "oneDNN fp16": lambda: torch.ops.mkldnn._linear_pointwise(x16, onednn_fp16, None, "none", [], ""),
        "aten bf16": lambda: torch.nn.functional.linear(xb, brain),
        "oneDNN bf16": lambda: torch.ops.mkldnn._linear_pointwise(xb, onednn_bf16, None, "none", [], ""),
        "int8 per channel (llmcli's)": lambda: torch._weight_int8pack_mm(xb, codes, scales.bfloat16()),
        "fbgemm int8, activations per tensor": lambda: torch.ops.quantized.linear_dynamic(
            x, int8_packed, True
        ),
        "int8 × int8 (_int_mm)": lambda: torch._int_mm(x8, codes_t),
    }


# One packed matrix in a process of its own: its growth in resident memory is the packed bytes
# (in a process that has freed memory before, the heap hands some of it back instead).
_PACKED_BYTES = """
import sys, torch
n, k = int(sys.argv[1]), int(sys.argv[2])
weight = torch.randn(n, k)
statm = lambda: int(open("/proc/self/statm").read().split()[1]) * 4096
before = statm()
packed = torch.ops.quantized.linear_prepack_fp16(weight, None)
print(statm() - before)
"""


def fbgemm_fp16_bytes(n: int, k: int) -> int:
    """The resident bytes of fbgemm's packed fp16 matrix (not a tensor: measured)."""
    done = subprocess.run(
        [sys.executable, "-c", _PACKED_BYTES, str(n), str(k)], capture_output=True, text=True
    )
    return int(done.stdout.split()[-1])


def main() -> None:
    kernels = numba_kernels() if importlib.util.find_spec("numba") else {}
    names = [*kernels, "torch fp16 dense", "torch int8 per channel", "torch int4 g32 (bf16)"]
    print(f"{torch.get_num_threads()} threads · median µs per call")
    print("| shape | " + " | ".join(names) + " |")
    print("|---|" + "---:|" * len(names))
    for n, k in SHAPES:
        cells = measure(n, k, kernels)
        print(f"| {n}×{k} | " + " | ".join(f"{c:.1f}" for c in cells) + " |")
    print(f"\ntorch's other CPU kernels · {torch.get_num_threads()} threads · median µs per call, batch 1")
    names = list(torch_kernels(64, 64))
    print("| shape | " + " | ".join(names) + " |")
    print("|---|" + "---:|" * len(names))
    for n, k in TORCH_SHAPES:
        cells = [f"{median_us(kernel):.1f}" for kernel in torch_kernels(n, k).values()]
        print(f"| {n}×{k} | " + " | ".join(cells) + " |")
    rows, widths = 8192, (576, 1024, 1536, 2048)
    held = ", ".join(
        f"{k}: {fbgemm_fp16_bytes(rows, k) / 1e6:.1f} MB ({rows * k * 2 / 1e6:.1f} in fp16)" for k in widths
    )
    print(f"\nfbgemm's packed fp16 matrix of {rows} rows, resident, by input width: {held}")


if __name__ == "__main__":
    main()
