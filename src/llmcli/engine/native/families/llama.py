"""The Llama family: Llama 2/3/3.1/3.2, Mistral, Qwen2/2.5, Qwen3, SmolLM.

    embedding → N × (RMSNorm → attention with RoPE and the KV cache → RMSNorm → gated MLP) → norm
    → logits

It reads the very tensors transformers loaded. The weights used together are stored together
(q/k/v as one matrix, gate/up as one), and transformers' own modules are pointed at views of
the fused matrices, so the model is still whole for transformers and no weight is held twice.
What differs between the members is settled once, here, when the model is built: QKV bias
(Qwen2), q/k RMSNorm (Qwen3), RoPE scaling (`llama3`, read from transformers' own inv_freq),
tied embeddings, grouped-query attention, a head_dim that is not hidden/heads, a sliding window
(Mistral v0.1, Qwen2's lower layers where enabled), its layers' KV cache a ring of the window.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from llmcli.engine.native.attention import Attention
from llmcli.engine.native.compiled_layer import CompiledLayer
from llmcli.engine.native.families.base import Block, Layer, NotSupported, Weights
from llmcli.engine.native.layers import FeedForward, RMSNorm, Shape, projection

# RoPE whose frequencies do not depend on the sequence length: the table transformers built at
# load time is the whole story. ("dynamic" and "longrope" rescale with the length.)
STATIC_ROPE_TYPES = frozenset({"default", "linear", "llama3", "yarn"})


def check_supported(model: Any, context_length: int, rope_types: frozenset[str] = STATIC_ROPE_TYPES) -> None:
    """Raise NotSupported unless `model` reduces to the architecture this module implements
    (`rope_types`: the RoPE types its family can settle once per load)."""
    config = model.config
    if getattr(config, "hidden_act", "silu") != "silu":
        raise NotSupported(f"activation {config.hidden_act!r}")
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    rope_type = rope.get("rope_type", rope.get("type", "default")) if isinstance(rope, dict) else "default"
    if rope_type not in rope_types:
        raise NotSupported(f"RoPE type {rope_type!r}")
    linears = [m for m in model.modules() if type(m).__name__.startswith("Linear")]
    if any(type(m) is not torch.nn.Linear for m in linears):
        raise NotSupported("quantized linear layers (bitsandbytes)")
    if len({p.device for p in model.parameters()}) > 1 or model.device.type == "meta":
        raise NotSupported("weights spread over several devices (--offload)")


def layer_windows(config: Any) -> list[int | None]:
    """Each layer's sliding window (Mistral v0.1's every layer, Qwen2's where its layer types
    say), or None: it attends to every position."""
    window = _sliding_window(config)
    kinds = getattr(config, "layer_types", None)
    return [
        window if kinds is None or kinds[i] == "sliding_attention" else None
        for i in range(config.num_hidden_layers)
    ]


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


def weights(
    model: Any,
    context_length: int | None = None,
    feed_forward: Callable[[Any, int], Layer] | None = None,
    rope: tuple[torch.Tensor, float] | None = None,
) -> Weights:
    """The model's tensors as the native forward reads them. `feed_forward(layer, index)` makes
    a layer's feed-forward (another family's, a mixture of experts); the gated MLP by default.
    `rope`: the RoPE frequencies and scale, where transformers' table is not the whole story."""
    config = model.config
    heads = config.num_attention_heads
    shape = Shape(
        layers=config.num_hidden_layers,
        heads=heads,
        kv_heads=getattr(config, "num_key_value_heads", None) or heads,
        head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
        eps=config.rms_norm_eps,
    )
    body = model.model
    windows = layer_windows(config)
    # A GGUF file's table kept packed (models/gguf_embedding.py) is read row by row.
    embedding = (
        body.embed_tokens.weight if isinstance(body.embed_tokens, torch.nn.Embedding) else body.embed_tokens
    )
    dtype = embedding.dtype  # what the norms' outputs go into
    inv_freq = rope[0] if rope else body.rotary_emb.inv_freq.float()
    return Weights(
        shape=shape,
        embedding=embedding,
        blocks=[
            _block(layer, shape, i, feed_forward, windows[i], dtype) for i, layer in enumerate(body.layers)
        ],
        norm=RMSNorm(body.norm.weight, shape.eps, dtype),
        output=projection(model.lm_head),  # the embedding itself when tied
        # transformers' own RoPE frequencies, with any scaling (llama3, linear, yarn) already in them.
        inv_freq=inv_freq,
        rope_scale=rope[1] if rope else float(getattr(body.rotary_emb, "attention_scaling", 1.0)),
        rope_axes=_multimodal_axes(config, inv_freq),
    )


def _multimodal_axes(config: Any, inv_freq: torch.Tensor) -> torch.Tensor | None:
    """Qwen2.5-VL's multimodal RoPE (its sections in consecutive chunks), where the config has
    it: an image's rows turn by three positions (models/vision/mrope.py)."""
    found = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    section = found.get("mrope_section") if isinstance(found, dict) else None
    if not section:
        return None
    from llmcli.models.vision.mrope import mrope_axes

    interleaved = bool(found.get("mrope_interleaved", False))
    return mrope_axes(section, inv_freq.shape[0], interleaved).to(inv_freq.device)


def _block(
    layer: Any,
    shape: Shape,
    index: int,
    feed_forward: Callable[[Any, int], Layer] | None,
    window: int | None,
    dtype: torch.dtype,
) -> Block:
    block = Block(
        attention_norm=RMSNorm(layer.input_layernorm.weight, shape.eps, dtype),
        attention=Attention(layer.self_attn, shape, index, window=window),
        ffn_norm=RMSNorm(layer.post_attention_layernorm.weight, shape.eps, dtype),
        feed_forward=feed_forward(layer, index) if feed_forward else FeedForward(layer.mlp),
    )
    block.compiled = CompiledLayer.of(layer, block)  # a GGUF file's blocks, on a CPU
    return block
