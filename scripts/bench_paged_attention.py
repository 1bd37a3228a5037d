"""Decode attention on the CPU, three ways, side by side: llmcli's kernel reading a paged pool's
blocks in place (engine/native/paged_cpu.py), torch's SDPA over a contiguous cache (today's CPU
path: one sequence's exact span of its bucket, or the slot pool's masked call for a batch), and
gathering the blocks into one tensor before that same SDPA (what a paged pool cost before).

Each cell is the median of several timed runs (each run a loop of calls) and the spread of those
runs (max − min), in microseconds per call; the paths take turns within each run so that a busy
machine slows them alike. Run it on a quiet machine:

    PYTHONPATH=src python scripts/bench_paged_attention.py [--dtype bf16] [--runs 9]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from llmcli.engine.native.kvcache import MIN_BUCKET
from llmcli.engine.native.paged_cpu import AttentionRules, PagedKV, paged_attention
from llmcli.models import cpu_kernels

SHAPES = {"SmolLM2-135M (9/3 × 64)": (9, 3, 64), "Llama-1B-like (32/8 × 64)": (32, 8, 64)}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _bucket(tokens: int) -> int:
    return max(MIN_BUCKET, 1 << (tokens - 1).bit_length())


def _paths(
    batch: int, tokens: int, heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype, block_size: int
) -> dict[str, Callable[[], torch.Tensor]]:
    """The three ways over the same keys and values (random: attention's cost does not depend on them)."""
    groups, scale = heads // kv_heads, head_dim**-0.5
    capacity = _bucket(tokens)
    # Today's caches: [kv_heads, capacity, d] per sequence, in a slot pool [B, ...] for a batch.
    cache_keys = torch.randn(batch, kv_heads, capacity, head_dim).to(dtype)
    cache_values = torch.randn(batch, kv_heads, capacity, head_dim).to(dtype)
    q_heads = torch.randn(batch, kv_heads, groups, head_dim).to(dtype)  # as Attention.attend lays it out
    mask = (torch.arange(capacity) < tokens).view(1, 1, 1, -1).expand(batch, 1, 1, -1)
    # A paged pool: each sequence's blocks scattered over it, as a pool that has run a while holds them.
    per_sequence = -(-tokens // block_size)
    num_blocks = batch * per_sequence * 2
    pool_keys = torch.randn(num_blocks, block_size, kv_heads, head_dim).to(dtype)
    pool_values = torch.randn(num_blocks, block_size, kv_heads, head_dim).to(dtype)
    tables = torch.randperm(num_blocks)[: batch * per_sequence].view(batch, per_sequence).to(torch.int32)
    lengths = torch.full((batch,), tokens, dtype=torch.int32)
    q_tokens = q_heads.reshape(batch, 1, heads, head_dim)

    def contiguous() -> torch.Tensor:
        if batch == 1:  # one sequence attends over exactly its span (Attention.attend)
            keys, values = cache_keys[0, :, :tokens], cache_values[0, :, :tokens]
            return F.scaled_dot_product_attention(q_heads, keys[None], values[None], scale=scale)
        return F.scaled_dot_product_attention(q_heads, cache_keys, cache_values, attn_mask=mask, scale=scale)

    def gathered() -> torch.Tensor:
        keys = pool_keys[tables.long()].flatten(1, 2)[:, :tokens].transpose(1, 2)
        values = pool_values[tables.long()].flatten(1, 2)[:, :tokens].transpose(1, 2)
        return F.scaled_dot_product_attention(q_heads, keys, values, scale=scale)

    paged, rules = PagedKV(pool_keys, pool_values, tables, lengths), AttentionRules(scale)

    def in_place() -> torch.Tensor:
        return paged_attention(q_tokens, paged, rules)

    return {"contiguous SDPA (today)": contiguous, "gather + SDPA": gathered, "blocks in place": in_place}


def _time(
    paths: dict[str, Callable[[], torch.Tensor]], runs: int, seconds: float, clock: Callable[[], float]
) -> dict[str, list[float]]:
    for call in paths.values():  # warm up, and size each path's loop to about `seconds`
        call()
    loops = {}
    for name, call in paths.items():
        start = clock()
        call()
        loops[name] = max(3, int(seconds / max(clock() - start, 1e-6)))
    timings: dict[str, list[float]] = {name: [] for name in paths}
    for _ in range(runs):
        for name, call in paths.items():
            start = clock()
            for _ in range(loops[name]):
                call()
            timings[name].append((clock() - start) / loops[name] * 1e6)
    return timings


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp32", help="the KV cache's dtype")
    parser.add_argument("--runs", type=int, default=7, help="timed runs per cell (the median is reported)")
    parser.add_argument("--seconds", type=float, default=0.05, help="about how long each timed run takes")
    parser.add_argument("--block-size", type=int, default=16, help="positions per block of the paged pool")
    parser.add_argument("--tokens", type=int, nargs="+", default=[300, 1000, 4000])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--threads", type=int, help="threads for torch and the kernel (default: torch's)")
    parser.add_argument(
        "--clock",
        choices=("wall", "cpu"),
        default="wall",
        help="cpu: the process's CPU time, steadier than wall time on a busy machine with --threads 1",
    )
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    clock = time.perf_counter if args.clock == "wall" else time.process_time
    loaded = cpu_kernels.kernels()
    if loaded is None:
        parser.error(f"no compiled kernels to measure ({cpu_kernels.which()})")
    dtype = DTYPES[args.dtype]
    threads, level = torch.get_num_threads(), loaded.level
    clock_name = f"{args.clock} time"
    print(f"# {args.dtype} KV, block size {args.block_size}, {threads} threads, llmcli {level}, {clock_name}")
    print("# µs per call: median (max − min of the runs); last column: in place / contiguous")
    names = ["contiguous SDPA (today)", "gather + SDPA", "blocks in place"]
    print(f"| shape | batch | tokens | {' | '.join(names)} | ratio |")
    print("|---|---:|---:|" + "---:|" * (len(names) + 1))
    with torch.inference_mode():
        for shape, (heads, kv_heads, head_dim) in SHAPES.items():
            for batch in args.batch:
                for tokens in args.tokens:
                    paths = _paths(batch, tokens, heads, kv_heads, head_dim, dtype, args.block_size)
                    timings = _time(paths, args.runs, args.seconds, clock)
                    medians = {name: statistics.median(times) for name, times in timings.items()}
                    cells = [f"{medians[n]:.1f} ({max(timings[n]) - min(timings[n]):.1f})" for n in names]
                    ratio = medians["blocks in place"] / medians["contiguous SDPA (today)"]
                    print(f"| {shape} | {batch} | {tokens} | {' | '.join(cells)} | {ratio:.2f} |", flush=True)


if __name__ == "__main__":
    main()
