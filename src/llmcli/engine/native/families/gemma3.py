"""Gemma 3 (`Gemma3ForCausalLM`, the text models) and Gemma 2 (`Gemma2ForCausalLM`).

    embedding × √hidden → N × (norm → attention → norm, added; norm → GeGLU → norm, added)
    → norm → logits

What differs from the Llama family, settled here when the model is built:
- norms before *and after* attention and the MLP, each Gemma's RMSNorm (scaled by 1 + weight,
  in fp32) — q and k are normalised per head the same way;
- attention scaled by `query_pre_attn_scalar`^-½, not head_dim^-½;
- sliding-window layers (each query sees the last `sliding_window` positions) interleaved with
  global ones, and a RoPE table for each kind (a local base, and the global one with its scaling);
- the MLP's gate through tanh-approximated gelu.

The sliding layers' KV cache is a ring of their window (kvcache.py): their memory stays flat
however long the text grows. Gemma 2 is the same model without q/k norms, with one RoPE table for
both kinds of layer, and with soft-capping: attention scores through cap · tanh(score / cap)
(scored by hand, attention.py) and the logits likewise.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F

from llmcli.engine.native.attention import Attention
from llmcli.engine.native.families import llama
from llmcli.engine.native.families.base import Block, NotSupported, Weights
from llmcli.engine.native.layers import FeedForward, Shape, projection

SLIDING = "sliding_attention"


def check_supported(model: Any, context_length: int) -> None:
    config = model.config
    if getattr(config, "use_bidirectional_attention", False):
        raise NotSupported("bidirectional attention (an embedding model)")
    if getattr(config, "hidden_activation", None) != "gelu_pytorch_tanh":
        raise NotSupported(f"activation {getattr(config, 'hidden_activation', None)!r}")
    ropes = getattr(config, "rope_parameters", None) or {}
    per_kind = ropes if all(isinstance(rope, dict) for rope in ropes.values()) else {"every": ropes}
    for kind, rope in per_kind.items():
        rope_type = rope.get("rope_type", "default")
        if rope_type not in llama.STATIC_ROPE_TYPES:
            raise NotSupported(f"RoPE type {rope_type!r} for {kind} layers")
    linears = [m for m in model.modules() if type(m).__name__.startswith("Linear")]
    if any(type(m) is not torch.nn.Linear for m in linears):
        raise NotSupported("quantized linear layers (bitsandbytes)")
    if len({p.device for p in model.parameters()}) > 1 or model.device.type == "meta":
        raise NotSupported("weights spread over several devices (--offload)")


class GemmaRMSNorm:
    """Gemma's RMSNorm: normalised and scaled by (1 + weight) in fp32, then rounded once."""

    def __init__(self, weight: torch.Tensor, eps: float) -> None:
        self.scale = 1.0 + weight.float()
        self.dtype = weight.dtype
        self.eps = eps

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return (F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps) * self.scale).to(self.dtype)


class GemmaBlock(Block):
    """Norms after attention and the MLP too, before each is added to the residual stream."""

    def __init__(self, layer: Any, attention: Attention, eps: float, rope: str) -> None:
        super().__init__(
            attention_norm=GemmaRMSNorm(layer.input_layernorm.weight, eps),
            attention=attention,
            ffn_norm=GemmaRMSNorm(layer.pre_feedforward_layernorm.weight, eps),
            feed_forward=FeedForward(layer.mlp, functools.partial(F.gelu, approximate="tanh")),
            rope=rope,
        )
        self.after_attention = GemmaRMSNorm(layer.post_attention_layernorm.weight, eps)
        self.after_feed_forward = GemmaRMSNorm(layer.post_feedforward_layernorm.weight, eps)

    def __call__(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, plan: Any) -> torch.Tensor:
        attention = self.attention
        q, k, v = attention.project(self.attention_norm(h), cos, sin)
        h = h + self.after_attention(attention.out(plan.attend(attention, q, k, v)))
        return h + self.after_feed_forward(self.feed_forward(self.ffn_norm(h)))


def _rope_table(rotary: Any, kind: str) -> tuple[torch.Tensor, float]:
    """Gemma 3's table for a kind of layer; Gemma 2 has one for both."""
    if not hasattr(rotary, f"{kind}_inv_freq"):
        return rotary.inv_freq.float(), float(getattr(rotary, "attention_scaling", 1.0))
    return getattr(rotary, f"{kind}_inv_freq").float(), float(getattr(rotary, f"{kind}_attention_scaling"))


def weights(model: Any, context_length: int) -> Weights:
    config = model.config
    heads = config.num_attention_heads
    shape = Shape(
        layers=config.num_hidden_layers,
        heads=heads,
        kv_heads=config.num_key_value_heads,
        head_dim=config.head_dim,
        eps=config.rms_norm_eps,
    )
    body = model.model
    kinds = config.layer_types
    blocks = []
    for index, layer in enumerate(body.layers):
        sliding = kinds[index] == SLIDING
        attention = Attention(
            layer.self_attn,
            shape,
            index,
            norm=GemmaRMSNorm,
            scale=config.query_pre_attn_scalar**-0.5,
            window=config.sliding_window if sliding else None,
            softcap=getattr(config, "attn_logit_softcapping", None),
        )
        blocks.append(GemmaBlock(layer, attention, shape.eps, "local" if sliding else "global"))
    norm = GemmaRMSNorm(body.norm.weight, shape.eps)
    return gemma_weights(body, config, model.lm_head, shape, blocks, norm)


def gemma_weights(
    body: Any, config: Any, head: Any, shape: Shape, blocks: list[Any], norm: Any, **extra: Any
) -> Weights:
    """A Gemma's weights around its blocks (Gemma 2, 3 and 4; `body`: its text model, `config`:
    that model's): transformers' own RoPE table per kind of layer, the embedding scaled by its own
    factor, the logits soft-capped where the config says; `extra`: further fields of Weights."""
    table = {kind: _rope_table(body.rotary_emb, kind) for kind in set(config.layer_types)}
    full = table.get("full_attention") or table[SLIDING]
    return Weights(
        shape=shape,
        embedding=body.embed_tokens.weight,
        blocks=blocks,
        norm=norm,
        output=projection(head),
        inv_freq=full[0],
        rope_scale=full[1],
        local_rope=table.get(SLIDING),
        embed_scale=float(body.embed_tokens.scalar_embed_scale),
        logit_softcap=getattr(config, "final_logit_softcapping", None),
        **extra,
    )
