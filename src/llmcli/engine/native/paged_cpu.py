"""Decode attention over a paged KV pool on the CPU, the blocks read where they lie.

The pool is [num_blocks, block_size, kv_heads, head_dim] per layer for keys and the same for
values; each sequence names its blocks in a row of `block_tables` and holds `lengths[b]`
positions. Each sequence's last `q_tokens` tokens ask (one for a decode step, a few for a
speculative check), each over the positions up to its own. llmcli's compiled kernel
(src/csrc/attention.c) does it in one call for the whole batch; gathering the blocks into one
tensor first, which torch's SDPA needs, cost +8 % at 300 tokens and +37 % at 1,000 (issue 28).

What the kernel does not take falls back to gathering, scored by hand in fp32 as attention.py
scores: a pool in another dtype than fp32, fp16 or bf16, one that is not contiguous (its blocks
cannot be addressed in place), a non-CPU tensor, or no compiled kernels (LLMCLI_CPU_KERNELS=off,
a build without a compiler). Sliding windows, Gemma 2's soft cap and gpt-oss's sinks are taken
by both paths.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from llmcli.engine.native.attention import _scored_attention
from llmcli.models import cpu_kernels
from llmcli.models.cpu_kernels import CpuKernels

# The pool dtypes the kernel reads, as src/csrc/llmcli_cpu.h numbers them (ggml's type ids).
_KERNEL_DTYPES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 30}
_UNSUPPORTED = -1  # the kernel's answer for a shape it does not take
_OUT_OF_POOL = -2


@dataclass(frozen=True)
class PagedKV:
    """One layer's pool as a batch of sequences sees it: keys and values [num_blocks, block_size,
    kv_heads, d], each sequence's block ids (block_tables [batch, max_blocks]) and the positions
    it holds (lengths [batch], its queries' own included)."""

    keys: torch.Tensor
    values: torch.Tensor
    block_tables: torch.Tensor
    lengths: torch.Tensor


@dataclass(frozen=True)
class AttentionRules:
    """How a query scores keys: `scale`; `window`: each query sees that many positions up to its
    own; `softcap`: scores pass through cap · tanh(score / cap) (Gemma 2); `sinks` [heads]: a
    logit per head that joins the softmax's denominator and takes no value (gpt-oss)."""

    scale: float
    window: int | None = None
    softcap: float | None = None
    sinks: torch.Tensor | None = None


def paged_attention(
    q: torch.Tensor,
    kv: PagedKV,
    rules: AttentionRules,
    *,
    kernels: CpuKernels | Literal["auto"] | None = "auto",
) -> torch.Tensor:
    """q [batch, q_tokens, heads, d], each sequence's last q_tokens positions → [batch, q_tokens,
    heads, d] in q's dtype. `kernels`: which compiled level runs ("auto": the one llmcli loads
    here; None: the gathering path)."""
    loaded = cpu_kernels.kernels() if isinstance(kernels, str) else kernels
    if loaded is not None and _kernel_takes(q, kv):
        out = _in_place(loaded, q, kv, rules)
        if out is not None:
            return out
    return gathered_attention(q, kv, rules)


def _kernel_takes(q: torch.Tensor, kv: PagedKV) -> bool:
    keys, values = kv.keys, kv.values
    return (
        keys.dtype in _KERNEL_DTYPES
        and values.dtype == keys.dtype
        and keys.shape == values.shape
        and keys.device.type == "cpu"
        and q.device.type == "cpu"
        and keys.is_contiguous()
        and values.is_contiguous()
    )


def _as(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`tensor` in `dtype`, contiguous; itself where it is already (this runs once a layer, and
    each needless torch call is a microsecond)."""
    if tensor.dtype != dtype:
        tensor = tensor.to(dtype)
    return tensor if tensor.is_contiguous() else tensor.contiguous()


def _in_place(loaded: CpuKernels, q: torch.Tensor, kv: PagedKV, rules: AttentionRules) -> torch.Tensor | None:
    """The kernel's answer, or None where it does not take this shape."""
    batch, q_tokens, heads, head_dim = q.shape
    num_blocks, block_size, kv_heads, _ = kv.keys.shape
    query, tables = _as(q, torch.float32), _as(kv.block_tables, torch.int32)
    held = _as(kv.lengths, torch.int32)
    sinks = _as(rules.sinks, torch.float32).data_ptr() if rules.sinks is not None else None
    out = torch.empty((batch, q_tokens, heads, head_dim), dtype=torch.float32)
    done = loaded.library.llmcli_paged_attention(
        _KERNEL_DTYPES[kv.keys.dtype], query.data_ptr(), kv.keys.data_ptr(), kv.values.data_ptr(),
        tables.data_ptr(), tables.shape[1], num_blocks, held.data_ptr(), sinks,
        batch, q_tokens, heads, kv_heads, head_dim, block_size, rules.scale, rules.window or 0,
        rules.softcap or 0.0, out.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    if done == _UNSUPPORTED:
        return None
    if done == _OUT_OF_POOL:
        raise ValueError("a sequence's length or block id lies outside the KV pool")
    if done != 0:
        raise MemoryError("llmcli's paged attention kernel ran out of memory")
    return out if q.dtype == torch.float32 else out.to(q.dtype)


def gathered_attention(q: torch.Tensor, kv: PagedKV, rules: AttentionRules) -> torch.Tensor:
    """`paged_attention` by gathering each sequence's blocks into one tensor first (the path
    for what the kernel does not take), scored in fp32."""
    q_tokens, heads = q.shape[1:3]
    _, block_size, kv_heads, _ = kv.keys.shape
    groups = heads // kv_heads
    out = torch.empty_like(q)
    sinks = rules.sinks.view(1, heads, 1).float() if rules.sinks is not None else None
    for b, length in enumerate(int(n) for n in kv.lengths):
        used = kv.block_tables[b, : -(-length // block_size)].long()
        # [kv_heads, length, d], then one copy per query head, as the scores are laid out.
        seq_keys, seq_values = (
            pool[used].flatten(0, 1)[:length].transpose(0, 1).float().repeat_interleave(groups, dim=0)[None]
            for pool in (kv.keys, kv.values)
        )
        own = torch.arange(length - q_tokens, length, device=q.device).view(-1, 1)
        seen = torch.arange(length, device=q.device).view(1, -1)
        mask = seen <= own
        if rules.window is not None:
            mask &= seen > own - rules.window
        query = q[b].transpose(0, 1)[None].float()  # [1, heads, q_tokens, d]
        attended = _scored_attention(query, seq_keys, seq_values, mask, rules.scale, sinks, rules.softcap)
        out[b] = attended[0].transpose(0, 1).to(q.dtype)
    return out
