"""Attention for the native forward: q/k/v projected (RoPE, optional q/k norms), then one of
the ways of attending that the plans (plans.py) choose between: over a chunk with the causal
rule, for one query over a span with an optional mask, or for several rows in one call.

Two variants SDPA cannot express are scored by hand (`_scored_attention`), as transformers' eager
code scores them: attention sinks (gpt-oss), a learned logit per head that joins the softmax's
denominator and takes no value; and soft-capping (Gemma 2), every score passed through
cap · tanh(score / cap) before the mask."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from llmcli.engine.native.layers import RMSNorm, Shape, identity, projection, rotate

# Masked decode attention over a bucket at least this long is split along the keys (buckets
# are powers of two ≥ 256 and rings multiples of 256 above it, so they divide into chunks evenly),
# for heads of up to 64; wider heads split from proportionally fewer slots, as the keys' bytes
# are what a head's one thread block walks (H100, d = 256: 512 slots 27 µs split against 35 µs
# through SDPA, a 1280-slot ring 30 against 71; d = 128, 1280 slots: 31 against 34).
SPLIT_ATTENTION_FROM = 2048
SPLIT_CHUNK = 256
# Scored by hand, a prefill chunk's scores are heads × rows × keys: its rows are taken in slices
# of at most this many scores.
SCORED_ELEMENTS = 1 << 25


class Attention:
    """`norm` makes q/k norms (Gemma's differ from Llama's); `scale` replaces 1/√head_dim;
    `window`: a sliding-window layer's span, each query attending to that many positions up to
    and including its own (None: all of them)."""

    # Whether an image's rows see each other both ways in a prefill here: set on the model's
    # layers where it reads images so (models/vision/encoder.py `bidirectional`).
    sees_images_whole = False

    def __init__(
        self,
        attn: Any,
        shape: Shape,
        layer: int,
        *,
        norm: Any = RMSNorm,
        scale: float | None = None,
        window: int | None = None,
        softcap: float | None = None,
    ) -> None:
        self.layer = layer
        self.shape = shape
        self.window = window
        # Phi-3 stores q, k and v fused in its checkpoint already.
        fused = getattr(attn, "qkv_proj", None)
        self.qkv = (
            projection(fused) if fused is not None else projection(attn.q_proj, attn.k_proj, attn.v_proj)
        )
        self.out = projection(attn.o_proj)
        self.sizes = [shape.heads * shape.head_dim, *[shape.kv_heads * shape.head_dim] * 2]
        # Qwen3 normalises each head of q and k before RoPE; the others do nothing there.
        q_norm, k_norm = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
        self.q_norm = norm(q_norm.weight, shape.eps) if q_norm is not None else identity
        self.k_norm = norm(k_norm.weight, shape.eps) if k_norm is not None else identity
        self.scale = scale if scale is not None else shape.head_dim**-0.5
        sinks = getattr(attn, "sinks", None)  # gpt-oss: one logit per head
        self.sinks = sinks.detach() if sinks is not None else None
        self.softcap = softcap
        self.scored = self.sinks is not None or softcap is not None  # by hand, not by SDPA

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """x [T, hidden] → q [heads, T, d], k and v [kv_heads, T, d], RoPE applied to q and k
        (cos and sin [T, 1, d]: Transformer.rope)."""
        tokens, d = x.shape[0], self.shape.head_dim
        qkv = self.qkv(x).view(tokens, -1, d)
        heads = self.shape.heads
        if self.q_norm is identity:
            # q and k lie side by side in qkv's output: one rotation covers both heads' sets.
            qk = rotate(qkv[:, : heads + self.shape.kv_heads], cos, sin)
            q, k = qk[:, :heads], qk[:, heads:]
        else:
            q = rotate(self.q_norm(qkv[:, :heads]), cos, sin)
            k = rotate(self.k_norm(qkv[:, heads : heads + self.shape.kv_heads]), cos, sin)
        v = qkv[:, heads + self.shape.kv_heads :]
        return q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)

    def attend(
        self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None
    ) -> torch.Tensor:
        """Attention alone for one query [heads, 1, d]: [1, heads × d], before the output projection.

        Grouped-query attention without copying keys: the G query heads that share a KV head
        are laid out as G "query positions" of that head, so one SDPA call covers them all.
        """
        shape = self.shape
        if mask is None and self.window is not None and keys.shape[1] > self.window:
            # Over exactly the positions seen (the query is the last): its window is the last ones.
            mask = (torch.arange(keys.shape[1], device=keys.device) >= keys.shape[1] - self.window).view(
                1, 1, 1, -1
            )
        groups = shape.heads // shape.kv_heads
        q = q.reshape(1, shape.kv_heads, groups, shape.head_dim)
        sinks = self.sinks.view(shape.kv_heads, groups) if self.sinks is not None else None
        if mask is not None and _splits(keys.shape[1], keys.shape[2]):
            out = _split_kv_attention(q[0] * self.scale, keys, values, mask, sinks, self.softcap)
        elif self.scored:
            sinks = sinks[None] if sinks is not None else None
            out = _scored_attention(q, keys[None], values[None], mask, self.scale, sinks, self.softcap)
        else:
            out = F.scaled_dot_product_attention(
                q, keys.unsqueeze(0), values.unsqueeze(0), attn_mask=mask, scale=self.scale
            )
        return out.reshape(1, -1)

    def attend_rows(
        self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        """Attention for R queries [heads, R, d] at once, row r over the slots mask[r] [R, S]
        allows: [R, heads × d]. One call for all rows (the graphed check pass), laid out as in
        `attend`: the G query heads of a KV head and the R rows are its G × R query positions."""
        shape = self.shape
        groups, rows = shape.heads // shape.kv_heads, q.shape[1]
        q = q.reshape(shape.kv_heads, groups * rows, shape.head_dim)
        mask = mask.repeat(groups, 1)  # query position g·R + r is row r
        sinks = None
        if self.sinks is not None:  # query position g·R + r is head kv·G + g
            sinks = (
                self.sinks.view(shape.kv_heads, groups, 1).expand(-1, -1, rows).reshape(shape.kv_heads, -1)
            )
        if _splits(keys.shape[1], keys.shape[2]):
            out = _split_kv_attention(q * self.scale, keys, values, mask[None], sinks, self.softcap)
        elif self.scored:
            sinks = sinks[None] if sinks is not None else None
            out = _scored_attention(
                q[None], keys[None], values[None], mask[None, None], self.scale, sinks, self.softcap
            )[0]
        else:
            out = F.scaled_dot_product_attention(
                q[None], keys[None], values[None], attn_mask=mask[None, None], scale=self.scale
            )[0]
        out = out.view(shape.kv_heads, groups, rows, shape.head_dim).permute(2, 0, 1, 3)
        return out.reshape(rows, -1)

    def attend_batch(
        self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        """One query for each of B sequences, q [heads, B, d], row b over its own keys and values
        [B, kv_heads, S, d] where mask[b] [1, 1, S] allows: [B, heads × d]. One call for them
        all, each sequence laid out as in `attend` (its G query heads of a KV head as G query
        positions)."""
        shape, count = self.shape, q.shape[1]
        queries = q.transpose(0, 1).reshape(count, shape.kv_heads, -1, shape.head_dim)
        if self.scored:
            sinks = self.sinks.view(1, shape.kv_heads, -1) if self.sinks is not None else None
            out = _scored_attention(queries, keys, values, mask, self.scale, sinks, self.softcap)
        else:
            out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=mask, scale=self.scale)
        return out.reshape(count, -1)

    def attend_causal(
        self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, both_ways: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Tokens q [heads, T, d] that are the last T of `keys`/`values`, each attending to
        everything up to itself: [T, heads × d], before the output projection. `both_ways`
        [T, T]: pairs of the chunk's rows that also see each other ahead (an image's rows,
        where the model reads an image whole: Gemma), still within a sliding window, as
        transformers masks them."""
        start = keys.shape[1] - q.shape[1]
        # A chunk after `start` cached tokens: row i sees positions ≤ start + i. From an empty
        # cache that is plain causal attention, which has the fastest kernels.
        mask = None
        windowed = self.window is not None and keys.shape[1] > self.window
        if (start > 0 and q.shape[1] > 1) or windowed or both_ways is not None:
            mask = torch.ones(q.shape[1], keys.shape[1], dtype=torch.bool, device=q.device).tril(start)
            if both_ways is not None:  # the chunk's last T keys; its last rows, where only they ask
                mask[:, keys.shape[1] - both_ways.shape[1] :] |= both_ways[-q.shape[1] :]
            if windowed:  # and positions > its own − window
                mask &= ~torch.ones_like(mask).tril(start - self.window)
        if self.scored:
            return self._causal_scored(q, keys, values, mask, start)
        out = F.scaled_dot_product_attention(
            q.unsqueeze(0),
            keys.unsqueeze(0),
            values.unsqueeze(0),
            attn_mask=mask,
            is_causal=mask is None and start == 0 and q.shape[1] > 1,
            scale=self.scale,
            enable_gqa=True,
        )
        return out[0].transpose(0, 1).reshape(q.shape[1], -1)

    def _causal_scored(
        self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None, start: int
    ) -> torch.Tensor:
        """`attend_causal` scored by hand, its rows in slices (the scores are made whole)."""
        rows, slots = q.shape[1], keys.shape[1]
        if mask is None:
            mask = torch.ones(rows, slots, dtype=torch.bool, device=q.device).tril(start)
        groups = self.shape.heads // self.shape.kv_heads
        keys = keys.repeat_interleave(groups, dim=0)[None]  # one per query head, as the scores are
        values = values.repeat_interleave(groups, dim=0)[None]
        step = max(1, SCORED_ELEMENTS // (self.shape.heads * (slots + 1)))
        sinks = self.sinks.view(1, -1, 1) if self.sinks is not None else None
        out = torch.cat([
            _scored_attention(
                q[None, :, i : i + step], keys, values, mask[i : i + step], self.scale, sinks, self.softcap
            )
            for i in range(0, rows, step)
        ], dim=2)  # fmt: skip
        return out[0].transpose(0, 1).reshape(rows, -1)


def _scored_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    sinks: torch.Tensor | None,
    softcap: float | None,
) -> torch.Tensor:
    """Attention scored by hand, in fp32: q [1, H, Q, d], keys and values [1, H, S, d], `mask`
    (bool, broadcastable to [1, H, Q, S]) or None, `sinks` (broadcastable to [1, H, Q]) or None
    → [1, H, Q, d]."""
    slots = keys.shape[2]
    scores = _capped(torch.matmul(q, keys.transpose(-1, -2)).float() * scale, softcap)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is not None:
        sink = sinks.float().unsqueeze(-1).expand(*scores.shape[:-1], 1)
        scores = torch.cat((scores, sink), dim=-1)
    probs = torch.softmax(scores, dim=-1)[..., :slots].to(values.dtype)
    return torch.matmul(probs, values)


def _capped(scores: torch.Tensor, softcap: float | None) -> torch.Tensor:
    return scores if softcap is None else torch.tanh(scores / softcap) * softcap


def _splits(slots: int, head_dim: int) -> bool:
    """Whether attention over `slots` keys is split along them: long, and in whole chunks (an
    exact span on a CPU is any length)."""
    return slots * max(head_dim, 64) >= SPLIT_ATTENTION_FROM * 64 and slots % SPLIT_CHUNK == 0


def _split_kv_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    sinks: torch.Tensor | None,
    softcap: float | None,
) -> torch.Tensor:
    """Decode attention over a long bucket, spread over the whole GPU.

    SDPA's kernels that take a mask give each head one thread block that walks every key, so a
    decode over 16k slots keeps 8 of 132 SMs busy (measured on an H100: 1B decode fell from 456
    to 172 tok/s at 8k tokens). Here the scores are one batched matmul split along the keys, the
    softmax one fp32 pass, and probs × values is computed per chunk of keys and summed, each
    step parallel over the key length. q [kv_heads, G, d] (already scaled), keys and values
    [kv_heads, S, d] with S a multiple of SPLIT_CHUNK, mask [1, 1, 1, S] (or one row per query
    position, [1, G, S]) → [kv_heads, G, d]. `sinks` [kv_heads, G]: each query position's sink
    logit, which joins the softmax and is dropped after it; `softcap`: Gemma 2's cap on scores.
    """
    kv_heads, slots, d = keys.shape
    scores = _capped(torch.matmul(q, keys.transpose(1, 2)).float(), softcap)
    scores = scores.masked_fill(~mask.view(1, -1, slots), float("-inf"))
    if sinks is not None:
        scores = torch.cat((scores, sinks.float().unsqueeze(-1)), dim=-1)
    probs = torch.softmax(scores, dim=-1)[..., :slots].to(values.dtype)
    chunks = slots // SPLIT_CHUNK
    probs = probs.view(kv_heads, -1, chunks, SPLIT_CHUNK).transpose(1, 2)
    partial = torch.matmul(probs, values.view(kv_heads, chunks, SPLIT_CHUNK, d))
    return partial.float().sum(dim=1).to(values.dtype)
