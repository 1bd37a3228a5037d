"""llmcli's own forward pass for the Llama family: Llama 2/3/3.1/3.2, Mistral, Qwen2/2.5, Qwen3, SmolLM.

    embedding → N × (RMSNorm → attention with RoPE and the KV cache → RMSNorm → gated MLP) → norm
    → logits of the last position only

It reads the very tensors transformers loaded. The weights used together are stored together
(q/k/v as one matrix, gate/up as one), and transformers' own modules are pointed at views of
the fused matrices, so the model is still whole for transformers and no weight is held twice.
What differs between the families is settled once, here, when the model is built: QKV bias
(Qwen2), q/k RMSNorm (Qwen3), RoPE scaling (`llama3`, read from transformers' own inv_freq),
tied embeddings, grouped-query attention, a head_dim that is not hidden/heads. The per-token
path has no configuration branches and no Python work that does not launch a kernel.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from llmcli.engine.native.kvcache import KVCache
from llmcli.models.quant import SUPPORTED_ARCHITECTURES

# RoPE whose frequencies do not depend on the sequence length: the table transformers built at
# load time is the whole story. ("dynamic" and "longrope" rescale with the length.)
STATIC_ROPE_TYPES = frozenset({"default", "linear", "llama3", "yarn"})
# Masked decode attention over a bucket at least this long is split along the keys (buckets
# are powers of two ≥ 256, so they divide into chunks evenly).
SPLIT_ATTENTION_FROM = 2048
SPLIT_CHUNK = 256


class NotSupported(Exception):
    """This model cannot run on the native engine; the message says why."""


def check_supported(model: Any, context_length: int) -> None:
    """Raise NotSupported unless `model` reduces to the architecture this module implements."""
    config = model.config
    name = type(model).__name__
    if name not in SUPPORTED_ARCHITECTURES:
        raise NotSupported(f"{name} is not in the Llama family")
    if getattr(config, "hidden_act", "silu") != "silu":
        raise NotSupported(f"activation {config.hidden_act!r}")
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    rope_type = rope.get("rope_type", rope.get("type", "default")) if isinstance(rope, dict) else "default"
    if rope_type not in STATIC_ROPE_TYPES:
        raise NotSupported(f"RoPE type {rope_type!r}")
    window = _sliding_window(config)
    if window is not None and window < context_length:
        raise NotSupported(
            f"sliding-window attention ({window} tokens) with a {context_length}-token context"
        )
    linears = [m for m in model.modules() if type(m).__name__.startswith("Linear")]
    if any(type(m) is not torch.nn.Linear for m in linears):
        raise NotSupported("quantized linear layers (bitsandbytes)")
    if len({p.device for p in model.parameters()}) > 1 or model.device.type == "meta":
        raise NotSupported("weights spread over several devices (--offload)")


def _sliding_window(config: Any) -> int | None:
    window = getattr(config, "sliding_window", None)
    if not window:
        return None
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        return window if "sliding_attention" in layer_types else None
    if getattr(config, "use_sliding_window", True) is False:  # Qwen2/3 carry a window they don't use
        return None
    return window


@dataclass(frozen=True)
class Shape:
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    eps: float


class RMSNorm:
    """transformers' RMSNorm: normalised in fp32, scaled in the model's dtype.

    On CUDA it is torch's one fused kernel (fp32 inside, the weight applied before the one
    rounding to bf16): four kernels fewer, and at batch 1 a decode step's time outside the
    matrix products is mostly kernel count. On a CPU the steps are transformers' own.
    """

    def __init__(self, weight: torch.Tensor, eps: float) -> None:
        self.weight = weight
        self.eps = eps
        self.fused = weight.device.type == "cuda"

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused:
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        return self.weight * normed.to(self.weight.dtype)


class FeedForward:
    """SwiGLU: down(silu(gate(x)) · up(x)), with gate and up as one matrix."""

    def __init__(self, mlp: Any) -> None:
        self.gate_up = _projection(mlp.gate_proj, mlp.up_proj)
        self.down = _projection(mlp.down_proj)
        self.intermediate = mlp.gate_proj.out_features

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).split(self.intermediate, dim=-1)
        return self.down(F.silu(gate) * up)


class Attention:
    def __init__(self, attn: Any, shape: Shape, layer: int) -> None:
        self.layer = layer
        self.shape = shape
        self.qkv = _projection(attn.q_proj, attn.k_proj, attn.v_proj)
        self.out = _projection(attn.o_proj)
        self.sizes = [shape.heads * shape.head_dim, *[shape.kv_heads * shape.head_dim] * 2]
        # Qwen3 normalises each head of q and k before RoPE; the others do nothing there.
        q_norm, k_norm = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
        self.q_norm = RMSNorm(q_norm.weight, shape.eps) if q_norm is not None else _identity
        self.k_norm = RMSNorm(k_norm.weight, shape.eps) if k_norm is not None else _identity
        self.scale = shape.head_dim**-0.5

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """x [T, hidden] → q [heads, T, d], k and v [kv_heads, T, d], RoPE applied to q and k."""
        tokens, d = x.shape[0], self.shape.head_dim
        qkv = self.qkv(x).view(tokens, -1, d)
        heads = self.shape.heads
        if self.q_norm is _identity:
            # q and k lie side by side in qkv's output: one rotation covers both heads' sets.
            qk = _rotate(qkv[:, : heads + self.shape.kv_heads], cos[:, None], sin[:, None])
            q, k = qk[:, :heads], qk[:, heads:]
        else:
            q = _rotate(self.q_norm(qkv[:, :heads]), cos[:, None], sin[:, None])
            k = _rotate(self.k_norm(qkv[:, heads : heads + self.shape.kv_heads]), cos[:, None], sin[:, None])
        v = qkv[:, heads + self.shape.kv_heads :]
        return q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)

    def prefill(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """Tokens at cache.length … cache.length + T − 1, each attending to everything before it."""
        q, k, v = self.project(x, cos, sin)
        keys, values = cache.write(self.layer, k, v)  # everything up to and including these tokens
        start = keys.shape[1] - q.shape[1]
        # A chunk after `start` cached tokens: row i sees positions ≤ start + i. From an empty
        # cache that is plain causal attention, which has the fastest kernels.
        mask = None
        if start > 0 and q.shape[1] > 1:
            mask = torch.ones(q.shape[1], keys.shape[1], dtype=torch.bool, device=x.device).tril(start)
        out = F.scaled_dot_product_attention(
            q.unsqueeze(0),
            keys.unsqueeze(0),
            values.unsqueeze(0),
            attn_mask=mask,
            is_causal=start == 0 and q.shape[1] > 1,
            scale=self.scale,
            enable_gqa=True,
        )
        return self.out(out[0].transpose(0, 1).reshape(x.shape[0], -1))

    def decode(
        self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None
    ) -> torch.Tensor:
        """One token's query [heads, 1, d] against `keys`/`values`, its own k/v already in them."""
        return self.out(self.attend(q, keys, values, mask))

    def attend(
        self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None
    ) -> torch.Tensor:
        """Attention alone for one query [heads, 1, d]: [1, heads × d], before the output projection.

        Grouped-query attention without copying keys: the G query heads that share a KV head
        are laid out as G "query positions" of that head, so one SDPA call covers them all.
        """
        shape = self.shape
        q = q.reshape(1, shape.kv_heads, shape.heads // shape.kv_heads, shape.head_dim)
        if mask is not None and keys.shape[1] >= SPLIT_ATTENTION_FROM:
            out = _split_kv_attention(q[0] * self.scale, keys, values, mask)
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
        if keys.shape[1] >= SPLIT_ATTENTION_FROM:
            out = _split_kv_attention(q * self.scale, keys, values, mask[None])
        else:
            out = F.scaled_dot_product_attention(
                q[None], keys[None], values[None], attn_mask=mask[None, None], scale=self.scale
            )[0]
        out = out.view(shape.kv_heads, groups, rows, shape.head_dim).permute(2, 0, 1, 3)
        return out.reshape(rows, -1)


class Block:
    def __init__(self, layer: Any, shape: Shape, index: int) -> None:
        self.attention_norm = RMSNorm(layer.input_layernorm.weight, shape.eps)
        self.attention = Attention(layer.self_attn, shape, index)
        self.ffn_norm = RMSNorm(layer.post_attention_layernorm.weight, shape.eps)
        self.feed_forward = FeedForward(layer.mlp)


class Transformer:
    """The model as a plain function of token ids, positions and a KVCache."""

    def __init__(self, model: Any) -> None:
        config = model.config
        heads = config.num_attention_heads
        self.shape = Shape(
            layers=config.num_hidden_layers,
            heads=heads,
            kv_heads=getattr(config, "num_key_value_heads", None) or heads,
            head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
            eps=config.rms_norm_eps,
        )
        body = model.model
        self.embedding = body.embed_tokens.weight
        self.blocks = [Block(layer, self.shape, i) for i, layer in enumerate(body.layers)]
        self.norm = RMSNorm(body.norm.weight, self.shape.eps)
        self.output = _projection(model.lm_head)  # the embedding itself when tied
        # transformers' own RoPE frequencies, with any scaling (llama3, linear, yarn) already in them.
        self.inv_freq = body.rotary_emb.inv_freq.float()
        self.rope_scale = float(getattr(body.rotary_emb, "attention_scaling", 1.0))
        self.device = self.embedding.device
        self.dtype = self.embedding.dtype
        # On a CPU the residual stream stays fp32 between layers (as llama.cpp keeps it): bf16
        # sums over 30 layers tipped the demo's near-tied first token, and it costs nothing there.
        self.residual_dtype = torch.float32 if self.device.type == "cpu" else self.dtype
        half = self.shape.head_dim // 2
        self.rope_sign = torch.tensor([-1.0] * half + [1.0] * half, dtype=self.dtype, device=self.device)

    def new_cache(self, context_length: int) -> KVCache:
        shape = self.shape
        return KVCache(shape.layers, shape.kv_heads, shape.head_dim, context_length, self.dtype, self.device)

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin [T, head_dim] for these positions, computed as transformers computes
        cos and sin (sin negated on its first half, for `_rotate`)."""
        freqs = positions.float()[:, None] * self.inv_freq
        angles = torch.cat((freqs, freqs), dim=-1)
        cos = (angles.cos() * self.rope_scale).to(self.dtype)
        return cos, (angles.sin() * self.rope_scale).to(self.dtype) * self.rope_sign

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.output(self.norm(h)).float()

    def prefill(self, ids: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """Run `ids` [T] after what `cache` holds; logits [1, vocab] for the token after them."""
        start = cache.length
        cache.ensure(start + ids.shape[0])
        cos, sin = self.rope(torch.arange(start, start + ids.shape[0], device=self.device))
        h = F.embedding(ids, self.embedding).to(self.residual_dtype)
        for block in self.blocks:
            h = h + block.attention.prefill(block.attention_norm(h), cos, sin, cache)
            h = h + block.feed_forward(block.ffn_norm(h))
        cache.length = start + ids.shape[0]
        return self.logits(h[-1:])

    def decode(
        self, token: torch.Tensor, position: torch.Tensor, cache: KVCache, attend: int, masked: bool
    ) -> torch.Tensor:
        """One token [1] at `position` (a [1] tensor on the device); logits [1, vocab].

        Attention reads the first `attend` cache slots. With `masked`, slots past `position` are
        masked out, so one fixed `attend` (a length bucket) serves every position below it: the
        shapes and addresses stay the same from token to token, which a CUDA graph needs.
        Without it, `attend` must be exactly position + 1. The caller advances cache.length.
        """
        cos, sin = self.rope(position)
        mask = None
        if masked:
            mask = (torch.arange(attend, device=self.device) <= position).view(1, 1, 1, attend)
        h = F.embedding(token, self.embedding).to(self.residual_dtype)
        for block in self.blocks:
            attention = block.attention
            q, k, v = attention.project(block.attention_norm(h), cos, sin)
            keys, values = cache.write_at(attention.layer, k, v, position, attend)
            h = h + attention.decode(q, keys, values, mask)
            h = h + block.feed_forward(block.ffn_norm(h))
        return self.logits(h)

    def verify(self, ids: torch.Tensor, cache: KVCache, buckets: bool) -> torch.Tensor:
        """Run `ids` [T] after what `cache` holds, in one pass; logits [T, vocab], row i exactly
        what the decode step would give after ids[: i + 1] — speculative decoding's check.

        The weights are read once for all T rows (their kernels compute each row alone, bit for
        bit as for one); attention runs per row, as the decode step runs it (over exactly the
        positions seen, or with `buckets` over the graph's bucket with a mask), because an
        attention kernel's result depends on how many keys it is handed.
        """
        start, count = cache.length, ids.shape[0]
        cache.ensure(start + count)
        cos, sin = self.rope(torch.arange(start, start + count, device=self.device))
        h = F.embedding(ids, self.embedding).to(self.residual_dtype)
        for block in self.blocks:
            attention = block.attention
            q, k, v = attention.project(block.attention_norm(h), cos, sin)
            cache.write(attention.layer, k, v)
            keys, values = cache.keys[attention.layer], cache.values[attention.layer]
            rows = []
            for i in range(count):
                seen = start + i + 1
                attend, mask = seen, None
                if buckets:
                    attend = cache.bucket_for(seen)
                    mask = (torch.arange(attend, device=self.device) < seen).view(1, 1, 1, attend)
                rows.append(attention.attend(q[:, i : i + 1], keys[:, :attend], values[:, :attend], mask))
            h = h + attention.out(torch.cat(rows))
            h = h + block.feed_forward(block.ffn_norm(h))
        cache.length = start + count
        return self.logits(h)

    def check_rows(
        self, tokens: torch.Tensor, positions: torch.Tensor, cache: KVCache, attend: int
    ) -> torch.Tensor:
        """The check pass with fixed shapes, for a CUDA graph: tokens [R] at `positions` [R] (on
        the device), each attending to the first `attend` slots up to its own position; logits
        [R, vocab]. All rows attend in one call per layer (a graph's launches do not depend on
        R); unlike `verify`, a row's rounding is not the decode step's bit for bit, as on a GPU
        the matrix products' are not either. The caller sets cache.length."""
        cos, sin = self.rope(positions)
        mask = torch.arange(attend, device=self.device)[None, :] <= positions[:, None]
        h = F.embedding(tokens, self.embedding).to(self.residual_dtype)
        for block in self.blocks:
            attention = block.attention
            q, k, v = attention.project(block.attention_norm(h), cos, sin)
            keys, values = cache.write_at(attention.layer, k, v, positions, attend)
            h = h + attention.out(attention.attend_rows(q, keys, values, mask))
            h = h + block.feed_forward(block.ffn_norm(h))
        return self.logits(h)


def _split_kv_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """Decode attention over a long bucket, spread over the whole GPU.

    SDPA's kernels that take a mask give each head one thread block that walks every key, so a
    decode over 16k slots keeps 8 of 132 SMs busy (measured on an H100: 1B decode fell from 456
    to 172 tok/s at 8k tokens). Here the scores are one batched matmul split along the keys, the
    softmax one fp32 pass, and probs × values is computed per chunk of keys and summed, each
    step parallel over the key length. q [kv_heads, G, d] (already scaled), keys and values
    [kv_heads, S, d] with S a multiple of SPLIT_CHUNK, mask [1, 1, 1, S] (or one row per query
    position, [1, G, S]) → [kv_heads, G, d].
    """
    kv_heads, slots, d = keys.shape
    scores = torch.matmul(q, keys.transpose(1, 2)).float()
    scores = scores.masked_fill(~mask.view(1, -1, slots), float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(values.dtype)
    chunks = slots // SPLIT_CHUNK
    probs = probs.view(kv_heads, -1, chunks, SPLIT_CHUNK).transpose(1, 2)
    partial = torch.matmul(probs, values.view(kv_heads, chunks, SPLIT_CHUNK, d))
    return partial.float().sum(dim=1).to(values.dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """RoPE as transformers applies it, x·cos + rotate_half(x)·sin, with rotate_half's minus
    sign folded into `signed_sin` (−sin on the first half): three kernels, not five."""
    half = x.shape[-1] // 2
    swapped = torch.cat((x[..., half:], x[..., :half]), dim=-1)
    return torch.addcmul(x * cos, swapped, signed_sin)


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x


def _projection(*linears: Any) -> Callable[[torch.Tensor], torch.Tensor]:
    """x → the outputs of `linears`, concatenated. Dense layers become one matrix product over
    their fused weights; quantized ones (their packed formats do not concatenate) run in turn."""
    if all(type(linear) is torch.nn.Linear for linear in linears):
        if len(linears) == 1:
            return functools.partial(F.linear, weight=linears[0].weight, bias=linears[0].bias)
        return functools.partial(F.linear, weight=_fuse(*linears), bias=_fuse_bias(*linears))
    if len(linears) == 1:
        return linears[0].forward
    if _slices_of_one_whole(linears):
        return linears[0].whole.forward  # quantized as one matrix (models/quantized.py)

    def each(x: torch.Tensor) -> torch.Tensor:
        return torch.cat([linear(x) for linear in linears], dim=-1)

    return each


def _slices_of_one_whole(linears: tuple[Any, ...]) -> bool:
    from llmcli.models.quantized import QuantizedSlice

    if not all(isinstance(linear, QuantizedSlice) for linear in linears):
        return False
    whole = linears[0].whole
    ends = [0] + [linear.end for linear in linears]
    return (
        all(linear.whole is whole and linear.start == end for linear, end in zip(linears, ends, strict=False))
        and ends[-1] == whole.out_features
    )


def _fuse(*linears: Any) -> torch.Tensor:
    """One matrix for linears that always run together, and the originals made views of it, so
    transformers' modules still work and the weights are not held twice. A model fused before
    (a second engine on the same model) is fused already."""
    previous = getattr(linears[0], "_llmcli_fused", None)
    if previous is not None and linears[0].weight.data_ptr() == previous.data_ptr():
        return previous
    fused = torch.cat([linear.weight.detach() for linear in linears], dim=0)
    linears[0]._llmcli_fused = fused
    offset = 0
    for linear in linears:
        rows = linear.weight.shape[0]
        linear.weight = torch.nn.Parameter(fused[offset : offset + rows], requires_grad=False)
        offset += rows
    return fused


def _fuse_bias(*linears: Any) -> torch.Tensor | None:
    if all(linear.bias is None for linear in linears):
        return None
    previous = getattr(linears[0], "_llmcli_fused_bias", None)
    if (
        previous is not None
        and linears[0].bias is not None
        and linears[0].bias.data_ptr() == previous.data_ptr()
    ):
        return previous
    parts = [
        linear.bias.detach()
        if linear.bias is not None
        else torch.zeros(linear.weight.shape[0], dtype=linear.weight.dtype, device=linear.weight.device)
        for linear in linears
    ]
    fused = torch.cat(parts)
    linears[0]._llmcli_fused_bias = fused
    offset = 0
    for linear, part in zip(linears, parts, strict=True):
        if linear.bias is not None:
            linear.bias = torch.nn.Parameter(fused[offset : offset + part.shape[0]], requires_grad=False)
        offset += part.shape[0]
    return fused
