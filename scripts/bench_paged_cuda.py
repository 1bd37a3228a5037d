"""Decode attention on a GPU, side by side: the Triton kernel reading a paged pool's blocks in
place (engine/native/paged_cuda.py), torch's SDPA over contiguous caches (today's GPU path: one
sequence's span, or a slot pool's masked call over a batch's longest), gathering the blocks
into one tensor before that SDPA, and flashinfer's paged decode where it is installed. What it
answers: which kernel the paged pool's decode step takes on a GPU, and which block size.

Each cell is µs per call, the median of 7 replays of a CUDA graph of 20 calls (as
bench_kernels.py times), after each path is checked against the gathered reference.

    python scripts/bench_paged_cuda.py [--dtype bf16] [--block-sizes 16 32]
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch
import torch.nn.functional as F

from bench_kernels import graph_time
from llmcli.engine.native.paged_cpu import AttentionRules, PagedKV, gathered_attention
from llmcli.engine.native.paged_cuda import paged_attention

SHAPES = {
    "Llama-8B (32/8 × 128)": (32, 8, 128),
    "Llama-1B (32/8 × 64)": (32, 8, 64),
    "Gemma-3 (8/4 × 256)": (8, 4, 256),
}
BATCHES = (1, 8, 16)
LENGTHS = (512, 2048, 8192)


def _paths(
    batch: int, tokens: int, heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype, block_size: int
) -> tuple[dict[str, Callable[[], torch.Tensor]], Callable[[], torch.Tensor]]:
    """Each way over the same keys and values, each returning [batch, 1, heads, d]; and the
    reference (paged_cpu.gathered_attention, sequence by sequence)."""
    device, scale = torch.device("cuda"), head_dim**-0.5
    per_sequence = -(-tokens // block_size)
    num_blocks = batch * per_sequence * 2  # scattered, as a pool that has run a while holds them
    keys = torch.randn(num_blocks, block_size, kv_heads, head_dim, device=device, dtype=dtype)
    values = torch.randn_like(keys)
    order = torch.randperm(num_blocks, device=device)[: batch * per_sequence]
    tables = order.view(batch, per_sequence).to(torch.int32)
    lengths = torch.full((batch,), tokens, dtype=torch.int32, device=device)
    kv, rules = PagedKV(keys, values, tables, lengths), AttentionRules(scale)
    q = torch.randn(batch, 1, heads, head_dim, device=device, dtype=dtype)
    # The contiguous caches: [batch, kv_heads, tokens, d], a query head group per KV head.
    cache_keys, cache_values = (
        pool[tables.long()].flatten(1, 2)[:, :tokens].transpose(1, 2).contiguous() for pool in (keys, values)
    )
    grouped = q.view(batch, kv_heads, heads // kv_heads, head_dim)

    def contiguous() -> torch.Tensor:
        out = F.scaled_dot_product_attention(grouped, cache_keys, cache_values, scale=scale)
        return out.reshape(batch, 1, heads, head_dim)

    def gathered() -> torch.Tensor:  # what a paged pool costs without a kernel that reads it
        seq_keys, seq_values = (
            pool[tables.long()].flatten(1, 2)[:, :tokens].transpose(1, 2) for pool in (keys, values)
        )
        out = F.scaled_dot_product_attention(grouped, seq_keys, seq_values, scale=scale)
        return out.reshape(batch, 1, heads, head_dim)

    paths = {
        "paged (Triton)": lambda: paged_attention(q, kv, rules),
        "contiguous SDPA": contiguous,
        "gathered + SDPA": gathered,
    }
    try:
        paths["flashinfer"] = _flashinfer(kv, q, tokens)
    except Exception as error:  # not installed (the usual case), or its API moved
        print(f"(flashinfer left out: {type(error).__name__}: {str(error)[:80]})")
    return paths, lambda: gathered_attention(q, kv, rules)


def _flashinfer(kv: PagedKV, q: torch.Tensor, tokens: int) -> Callable[[], torch.Tensor]:
    """flashinfer's paged decode on the same pool ("NHD" is this layout), graph-capturable."""
    import flashinfer

    batch, _, heads, head_dim = q.shape
    per_sequence, block_size, kv_heads = kv.block_tables.shape[1], kv.keys.shape[1], kv.keys.shape[2]
    device = q.device
    indptr = torch.arange(batch + 1, device=device, dtype=torch.int32) * per_sequence
    indices = kv.block_tables.flatten().contiguous()
    last = torch.full((batch,), tokens - (per_sequence - 1) * block_size, dtype=torch.int32, device=device)
    workspace = torch.empty(128 << 20, dtype=torch.uint8, device=device)
    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
        workspace, "NHD", use_cuda_graph=True, paged_kv_indptr_buffer=indptr,
        paged_kv_indices_buffer=indices, paged_kv_last_page_len_buffer=last,
    )  # fmt: skip
    wrapper.plan(indptr, indices, last, heads, kv_heads, head_dim, block_size, q_data_type=q.dtype)
    return lambda: wrapper.run(q[:, 0], (kv.keys, kv.values)).view(batch, 1, heads, head_dim)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16")
    parser.add_argument("--block-sizes", type=int, nargs="+", default=[16, 32])
    args = parser.parse_args()
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float16
    print(f"{torch.cuda.get_device_name()}, {args.dtype}: µs per decode attention call (one layer)\n")
    for name, (heads, kv_heads, head_dim) in SHAPES.items():
        for block_size in args.block_sizes:
            print(f"### {name}, blocks of {block_size}\n")
            header_done = False
            for batch in BATCHES:
                for tokens in LENGTHS:
                    paths, reference_path = _paths(
                        batch, tokens, heads, kv_heads, head_dim, dtype, block_size
                    )
                    if not header_done:
                        print("| batch × tokens | " + " | ".join(paths) + " |")
                        print("|---|" + "---|" * len(paths))
                        header_done = True
                    reference = reference_path().float()  # per sequence, eager: not graphed
                    cells = []
                    for fn in paths.values():
                        torch.testing.assert_close(fn().float(), reference, rtol=0, atol=2e-2)
                        cells.append(f"{graph_time(fn) * 1e6:.1f}")
                    print(f"| {batch} × {tokens} | " + " | ".join(cells) + " |")
            print()


if __name__ == "__main__":
    main()
