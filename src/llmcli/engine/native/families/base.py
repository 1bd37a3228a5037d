"""What a family module gives the native forward: its weights, as blocks the one layer loop
(forward.py) runs. A family settles its differences when the model is built, never per token."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from llmcli.engine.native.attention import Attention
    from llmcli.engine.native.compiled_layer import CompiledLayer
    from llmcli.engine.native.layers import Shape
    from llmcli.engine.native.plans import Plan

Layer = Callable[[torch.Tensor], torch.Tensor]


class NotSupported(Exception):
    """This model cannot run on the native engine; the message says why."""


@dataclass
class Block:
    """One transformer layer: a norm, attention, a norm, a feed-forward, each added to the
    residual stream. (A family with a norm after attention, or another feed-forward such as
    a mixture of experts, brings its own block with the same call.)"""

    attention_norm: Layer
    attention: Attention
    ffn_norm: Layer
    feed_forward: Layer
    rope: str = "global"  # which of the model's RoPE tables (Weights.local_rope) its attention uses
    # The block around its attention in llmcli's compiled kernels (compiled_layer.py), where taken.
    compiled: CompiledLayer | None = None

    def __call__(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, plan: Plan) -> torch.Tensor:
        compiled = self.compiled
        if compiled is not None and compiled.usable(h, cos):
            return compiled(h, cos, sin, plan, self.attention)
        attention = self.attention
        q, k, v = attention.project(self.attention_norm(h), cos, sin)
        h = h + attention.out(plan.attend(attention, q, k, v))
        return h + self.feed_forward(self.ffn_norm(h))


class RowLookup(Protocol):
    """An embedding held in a packed form (a GGUF file's blocks), whose rows are read on demand:
    the forward calls `rows` where a tensor would be indexed."""

    dtype: torch.dtype
    device: torch.device
    shape: tuple[int, int]  # [vocabulary, hidden], as the tensor's

    def rows(self, tokens: torch.Tensor) -> torch.Tensor: ...


@dataclass
class Weights:
    shape: Shape
    embedding: torch.Tensor | RowLookup
    blocks: list[Block]
    norm: Layer
    output: Layer
    inv_freq: torch.Tensor  # RoPE frequencies, any scaling already in them
    rope_scale: float
    # A second RoPE table, for the blocks whose `rope` is "local" (Gemma 3's sliding layers).
    local_rope: tuple[torch.Tensor, float] | None = None
    embed_scale: float | None = None  # the embedding is multiplied by this (Gemma: √hidden)
    logit_softcap: float | None = None  # logits through cap · tanh(logit / cap) (Gemma 2)
    # Run once a pass on the tokens and their (scaled) embeddings before the blocks: Gemma 4's
    # per-layer inputs, which its blocks then read.
    before_blocks: Callable[[torch.Tensor, torch.Tensor], None] | None = None
    # Qwen-VL's multimodal RoPE: which of an image row's three positions (time, height, width)
    # each frequency of the table turns by (mrope_axes); None: one position per token.
    rope_axes: torch.Tensor | None = None
