"""Decode attention over a paged KV pool on a GPU: a Triton kernel that reads each sequence's
blocks where they lie, through its block table.

The pool is the one paged_cpu.py reads (PagedKV): keys and values [num_blocks, block_size,
kv_heads, head_dim] per layer, a row of `block_tables` per sequence, `lengths[b]` positions
held, its last `q_tokens` positions asking (one for a decode step, a few for a speculative
check), each over the positions up to its own. One layout for both devices, so the block pool
(blocks.py) and the scheduler above it do not care which kernel reads it.

One program takes one query token of one sequence and one KV head: the G query heads that share
that KV head (grouped-query attention) are scored together, so each key and value is read once
per group. Keys are read in tiles of TILE positions, each position's block looked up in the
table (a tile may span blocks, so any block size works, and head widths are padded to a power
of two and masked: 80 and 96 as well as 64/128/256). The softmax is online (flash-decoding's
running maximum and sum, in fp32), with gpt-oss's sinks as its starting point (maximum = the
sink's logit, sum = 1: the sink joins the denominator and adds no value), Gemma 2's soft cap
on the scaled scores, and a sliding window by starting the walk at the window's first position.
A sequence of length 0 (a padded row of a graphed batch) gives zeros, not NaN.

What the kernel does not take falls back to paged_cpu.gathered_attention (the blocks gathered
and scored by torch, correct on any device): a pool in another dtype than fp32, fp16 or bf16,
head widths above 512, a head dimension that is not contiguous, query heads that are not a
multiple of the KV heads, and tensors that are neither on a GPU nor on the CPU under Triton's
interpreter (TRITON_INTERPRET=1, which is how CI runs this kernel). Block ids are trusted: the
block pool hands out only its own; checking them here would cost a host sync per layer, which a
CUDA graph cannot take.

Not done here, for the first GPU to decide: one program walks a whole sequence, so a batch of
few long sequences keeps few SMs busy (split-K over the positions, merged afterwards, is the
known remedy: attention.py's _split_kv_attention does it for the contiguous cache); and scores
are a broadcast product in fp32 registers, not tl.dot (tensor cores need ≥ 16 rows, and a decode
group has 1–8 heads; fp32 tl.dot would also default to TF32).

The choice against an existing kernel from the package index (checked with pip, Nov 2026):
- flash-attn 2.8.3 (`flash_attn_with_kvcache(..., block_table=...)`): a source distribution only;
  its build imports torch and compiles CUDA with nvcc (hours, a toolkit the user may not have).
  Its paged layout is [num_blocks, block_size, kv_heads, d], this one, with block sizes a
  multiple of 256 in the versions that take block tables (too coarse to share prefixes well).
- vllm 0.33: a wheel, but it pins torch==2.14.0 (llmcli runs 2.13), torchaudio and torchvision:
  installing it would replace the user's torch. Far too heavy a dependency for one kernel.
- flashinfer-python 0.7.2: a pure-Python wheel whose CUDA kernels are compiled at first use
  (nvcc needed) or come from a separate flashinfer-cubin package of prebuilt binaries; it
  takes paged KV (its "NHD" layout is this one), GQA, soft caps and windows (sinks not checked).
So Triton (already what llmcli's GPU kernels use, installed with torch on CUDA) is the default.
What the first GPU must compare: `python scripts/bench_paged_cuda.py` (this kernel against the
contiguous cache's SDPA and against gathering, 1/8/16 sequences of 512–8k tokens, Llama-8B,
Llama-1B and Gemma-3-4B heads, blocks of 16 and 32, each in a CUDA graph), and `pytest -m gpu
tests/test_paged_cuda.py tests/test_paged_kvcache.py` (the kernel on cuda, captured in a graph
and replayed on changed tables; the paged engine's greedy tokens). The script also times
flashinfer's BatchDecodeWithPagedKVCacheWrapper on the same pool where flashinfer is installed;
adopt it only if it is clearly faster and installs as an optional extra.
"""

from __future__ import annotations

import functools
import os
from typing import Any

import torch

from llmcli.engine.native.paged_cpu import AttentionRules, PagedKV, gathered_attention

_KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MAX_HEAD_DIM = 512
# Elements of a program's [heads, TILE, d] product held in registers at once: TILE is chosen so
# that wide heads take short tiles (d = 256 with 4 heads: 8 positions; d = 64, 1 head: 64).
_TILE_ELEMENTS = 8192
_NO_WINDOW = 1 << 30  # a window wider than any context: every position up to the query's


def paged_attention(q: torch.Tensor, kv: PagedKV, rules: AttentionRules) -> torch.Tensor:
    """q [batch, q_tokens, heads, d], each sequence's last q_tokens positions → [batch, q_tokens,
    heads, d] in q's dtype; by the kernel where it takes the shapes, else by gathering."""
    if not kernel_takes(q, kv):
        return gathered_attention(q, kv, rules)
    batch, q_tokens, heads, head_dim = q.shape
    kv_heads = kv.keys.shape[2]
    groups = heads // kv_heads
    q = q.contiguous()
    tables = kv.block_tables.to(torch.int32).contiguous()  # itself where it is so already
    lengths = kv.lengths.to(torch.int32).contiguous()
    sinks = rules.sinks.float().contiguous() if rules.sinks is not None else q  # q: an unread stand-in
    out = torch.empty_like(q)
    group_pad = _power_of_two(groups)
    dim_pad = _power_of_two(head_dim)
    tile = max(8, min(64, _TILE_ELEMENTS // (group_pad * dim_pad)))
    _kernel()[(batch * q_tokens, kv_heads)](
        q, kv.keys, kv.values, tables, lengths, sinks, out,
        q_tokens, kv.keys.shape[1], tables.stride(0),
        kv.keys.stride(0), kv.keys.stride(1), kv.keys.stride(2),
        kv.values.stride(0), kv.values.stride(1), kv.values.stride(2),
        rules.scale, rules.window or _NO_WINDOW, rules.softcap or 1.0,
        HEADS=heads, GROUPS=groups, GROUP_PAD=group_pad, HEAD_DIM=head_dim, DIM_PAD=dim_pad,
        TILE=tile, HAS_SINKS=rules.sinks is not None, HAS_SOFTCAP=rules.softcap is not None,
        num_warps=4 if group_pad * dim_pad * tile <= 8192 else 8,
    )  # fmt: skip
    return out


def kernel_takes(q: torch.Tensor, kv: PagedKV) -> bool:
    """Whether the kernel reads this pool in place (else paged_attention gathers)."""
    keys, values = kv.keys, kv.values
    heads, head_dim = q.shape[2], q.shape[3]
    runs_here = q.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"
    return (
        runs_here
        and keys.device == q.device == values.device
        and keys.dtype in _KERNEL_DTYPES
        and values.dtype == keys.dtype
        and q.dtype in _KERNEL_DTYPES
        and keys.shape == values.shape
        and keys.shape[3] == head_dim <= MAX_HEAD_DIM
        and heads % keys.shape[2] == 0
        and keys.stride(3) == 1
        and values.stride(3) == 1
    )


def _power_of_two(n: int) -> int:
    return 1 << (n - 1).bit_length()


@functools.cache
def _kernel() -> Any:  # a triton.JITFunction; triton is imported only where it runs
    import triton
    import triton.language as tl

    @triton.jit
    def paged_decode_attention(
        q,
        keys,
        values,
        tables,
        lengths,
        sinks,
        out,
        q_tokens,
        block_size,
        table_stride,
        k_block_stride,
        k_position_stride,
        k_head_stride,
        v_block_stride,
        v_position_stride,
        v_head_stride,
        scale,
        window,
        softcap,
        HEADS: tl.constexpr,
        GROUPS: tl.constexpr,
        GROUP_PAD: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        DIM_PAD: tl.constexpr,
        TILE: tl.constexpr,
        HAS_SINKS: tl.constexpr,
        HAS_SOFTCAP: tl.constexpr,
    ):
        row = tl.program_id(0)  # sequence · q_tokens + its query token
        kv_head = tl.program_id(1)
        sequence = row // q_tokens
        length = tl.load(lengths + sequence)
        own = length - q_tokens + row % q_tokens  # this query's position: it sees up to here
        heads = kv_head * GROUPS + tl.arange(0, GROUP_PAD)
        heads_live = tl.arange(0, GROUP_PAD) < GROUPS
        dims = tl.arange(0, DIM_PAD)
        dims_live = dims < HEAD_DIM
        q_tile = heads_live[:, None] & dims_live[None, :]
        q_at = row * HEADS * HEAD_DIM + heads[:, None] * HEAD_DIM + dims[None, :]
        query = tl.load(q + q_at, mask=q_tile, other=0.0).to(tl.float32) * scale
        if HAS_SINKS:
            # The sink as the softmax's starting point: exp(sink − maximum) = 1 is in the sum.
            maximum = tl.load(sinks + heads, mask=heads_live, other=0.0)
            total = tl.full((GROUP_PAD,), 1.0, tl.float32)
        else:
            # Finite: a tile all masked must not make exp(−inf − (−inf)).
            maximum = tl.full((GROUP_PAD,), -1.0e30, tl.float32)
            total = tl.zeros((GROUP_PAD,), tl.float32)
        acc = tl.zeros((GROUP_PAD, DIM_PAD), tl.float32)
        first = tl.maximum(own - window + 1, 0)
        table = tables + sequence * table_stride
        for start in range(first, own + 1, TILE):
            positions = start + tl.arange(0, TILE)
            seen = positions <= own
            block = tl.load(table + positions // block_size, mask=seen, other=0).to(tl.int64)
            slot = (positions % block_size).to(tl.int64)
            tile = seen[:, None] & dims_live[None, :]
            k_at = block * k_block_stride + slot * k_position_stride + kv_head * k_head_stride
            k = tl.load(keys + k_at[:, None] + dims[None, :], mask=tile, other=0.0).to(tl.float32)
            scores = tl.sum(query[:, None, :] * k[None, :, :], axis=2)  # [GROUP_PAD, TILE]
            if HAS_SOFTCAP:  # cap · tanh(score / cap), tanh from one exp of a non-positive number
                bent = tl.exp(-2.0 * tl.abs(scores / softcap))
                tanh = (1.0 - bent) / (1.0 + bent)
                scores = softcap * tl.where(scores < 0, -tanh, tanh)
            scores = tl.where(seen[None, :], scores, float("-inf"))
            new_maximum = tl.maximum(maximum, tl.max(scores, axis=1))
            rescale = tl.exp(maximum - new_maximum)
            weights = tl.exp(scores - new_maximum[:, None])
            total = total * rescale + tl.sum(weights, axis=1)
            v_at = block * v_block_stride + slot * v_position_stride + kv_head * v_head_stride
            v = tl.load(values + v_at[:, None] + dims[None, :], mask=tile, other=0.0).to(tl.float32)
            acc = acc * rescale[:, None] + tl.sum(weights[:, :, None] * v[None, :, :], axis=1)
            maximum = new_maximum
        total = tl.where(total > 0, total, 1.0)  # a length-0 row: zeros
        tl.store(out + q_at, (acc / total[:, None]).to(out.dtype.element_ty), mask=q_tile)

    return paged_decode_attention
