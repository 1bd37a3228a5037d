"""Qwen3.5 (dense): Gated DeltaNet layers beside gated full-attention ones.

    embedding → N × (RMSNorm → Gated DeltaNet or gated attention → RMSNorm → gated MLP) → norm
    → logits

A linear-attention layer (gated_deltanet.py) carries a recurrent state per sequence instead of
keys and values; the cache holds it beside the attention layers' KV, with checkpoints of it a
crop goes back to (recurrent_cache.py). A full-attention layer doubles its q_proj into the query
and a gate, each head's query then its gate, and the attention's output is multiplied by
sigmoid(gate) before o_proj; q and k are normed per head; a quarter of each head is rotated (the
text's mrope sections are one position: plain RoPE).
Every RMSNorm but the DeltaNet's own scales by (1 + weight), as Gemma's does. The MoE sibling
(Qwen3.5-MoE) has the same layers with a router's experts and a gated shared expert in place of
the MLP (shared_expert.py).

A step of one sequence is what this module runs: a prefill chunk, the exact decode step and a
speculative check row by row; and one decode step of several sequences (a server's, a batch's),
their states stacked as the rows of one. The bucketed step a CUDA graph replays and the graphed
check are refused (the backend does not ask for them: a state has no fixed-shape step yet).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import torch

from llmcli.engine.native.attention import Attention
from llmcli.engine.native.families.base import Layer, Weights
from llmcli.engine.native.families.gemma3 import GemmaRMSNorm
from llmcli.engine.native.families.llama import check_supported as check_llama
from llmcli.engine.native.families.moe import check_stacked_experts
from llmcli.engine.native.families.shared_expert import feed_forward
from llmcli.engine.native.gated_deltanet import (
    DeltaNetShape,
    DeltaNetState,
    DeltaNetWeights,
    decode_step,
    grouped_order,
    prefill,
)
from llmcli.engine.native.layers import Shape, projection, rotate
from llmcli.engine.native.plans import CausalChunk, ExactDecode, PerRowCheck, SequencesStep
from llmcli.errors import LlmcliError
from llmcli.models.vision.mrope import mrope_axes

if TYPE_CHECKING:
    from llmcli.engine.native.plans import Plan
    from llmcli.engine.native.recurrent_cache import RecurrentCache

LINEAR = "linear_attention"


def check_supported(model: Any, context_length: int) -> None:
    """As a Llama's (silu, a RoPE settled once, plain linear layers, one device), and the MoE
    family's stacked experts where there are experts."""
    check_llama(model, context_length)
    check_stacked_experts(model)


def weights(model: Any, context_length: int) -> Weights:
    config = model.config
    heads = (config.num_attention_heads, config.num_key_value_heads)
    shape = Shape(config.num_hidden_layers, *heads, config.head_dim, config.rms_norm_eps)
    linear_shape = DeltaNetShape.from_config(config)
    body = model.model
    # The MoE rows' router renormalises its top-k weights unless the config says not (Qwen3-Next).
    normalise = bool(getattr(config, "norm_topk_prob", True))
    blocks: list[Any] = []
    for index, layer in enumerate(body.layers):
        mlp = feed_forward(layer.mlp, normalise)
        if config.layer_types[index] == LINEAR:
            blocks.append(DeltaNetBlock(layer, index, linear_shape, shape.eps, mlp))
        else:
            attention = GatedAttention(layer.self_attn, shape, index, norm=GemmaRMSNorm)
            blocks.append(GatedBlock(layer, attention, shape.eps, mlp))
    rotary = body.rotary_emb  # a quarter of each head's width: rotate() passes the rest unrotated
    rope = rotary.inv_freq.float(), float(getattr(rotary, "attention_scaling", 1.0))
    final_norm = GemmaRMSNorm(body.norm.weight, shape.eps)
    # A GGUF file's table kept packed (models/gguf_embedding.py) is read row by row.
    table = body.embed_tokens
    embedding = table.weight if isinstance(table, torch.nn.Embedding) else table
    # Qwen3.5's multimodal RoPE turns its frequencies interleaved, whatever the config says (as
    # transformers' rotary embedding does); text alone is one position on every axis.
    section = (getattr(config, "rope_parameters", None) or {}).get("mrope_section")
    axes = mrope_axes(section, rope[0].shape[0], interleaved=True).to(rope[0].device) if section else None
    return Weights(shape, embedding, blocks, final_norm, projection(model.lm_head), *rope, rope_axes=axes)


class GatedAttention(Attention):
    """q_proj's rows are each head's query then its gate: both come out of one projection."""

    def project_gated(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [T, hidden] → q [heads, T, d], k and v [kv_heads, T, d] (as Attention.project), and
        the gate [T, heads × d] the attention's output is multiplied by, through a sigmoid."""
        tokens, d = x.shape[0], self.shape.head_dim
        heads, kv_heads = self.shape.heads, self.shape.kv_heads
        qkv = self.qkv(x).view(tokens, -1, d)
        query_and_gate = qkv[:, : 2 * heads].reshape(tokens, heads, 2, d)
        q = rotate(self.q_norm(query_and_gate[:, :, 0]), cos, sin)
        gate = query_and_gate[:, :, 1].reshape(tokens, heads * d)
        k = rotate(self.k_norm(qkv[:, 2 * heads : 2 * heads + kv_heads]), cos, sin)
        v = qkv[:, 2 * heads + kv_heads :]
        return q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), gate


class GatedBlock:
    """A full-attention layer: its attention's output gated before o_proj."""

    rope = "global"

    def __init__(self, layer: Any, attention: GatedAttention, eps: float, feed_forward: Layer) -> None:
        self.attention = attention
        self.attention_norm = GemmaRMSNorm(layer.input_layernorm.weight, eps)
        self.ffn_norm = GemmaRMSNorm(layer.post_attention_layernorm.weight, eps)
        self.feed_forward = feed_forward

    def __call__(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, plan: Plan) -> torch.Tensor:
        attention = self.attention
        q, k, v, gate = attention.project_gated(self.attention_norm(h), cos, sin)
        h = h + attention.out(plan.attend(attention, q, k, v) * torch.sigmoid(gate))
        return h + self.feed_forward(self.ffn_norm(h))


def mixer_weights(mixer: Any, shape: DeltaNetShape) -> DeltaNetWeights:
    """A Gated DeltaNet module's weights, its shapes checked. Its projections run as the native
    engine runs any linear layer (layers.projection): Qwen3.5's four input projections as one
    matrix whose parts the module's own become views of (so the weights are not held twice), or
    quantized ones as the one matrix --quant made of them."""
    tensors = dict(mixer.named_parameters())
    for name, module in mixer.named_children():
        if name.startswith(("in_proj", "out_proj")) and type(module) is not torch.nn.Linear:
            # Quantized: the shapes to check, not weights (its packed ones are not a matrix).
            tensors[f"{name}.weight"] = torch.empty(module.out_features, module.in_features, device="meta")
    weights = DeltaNetWeights.from_tensors(tensors, shape)
    out_proj = projection(mixer.out_proj)
    if hasattr(mixer, "in_proj_qkv"):
        parts = (mixer.in_proj_qkv, mixer.in_proj_z, mixer.in_proj_b, mixer.in_proj_a)
        return dataclasses.replace(weights, in_proj=projection(*parts), out_proj=out_proj)
    # Qwen3-Next's two projections, their rows grouped per key head: one product, its outputs
    # then put in Qwen3.5's order (a gather of a row, not a second copy of the weights).
    grouped, order = projection(mixer.in_proj_qkvz, mixer.in_proj_ba), grouped_order(shape)

    def in_proj(x: torch.Tensor) -> torch.Tensor:
        return grouped(x).index_select(-1, order.to(x.device))

    return dataclasses.replace(weights, in_proj=in_proj, out_proj=out_proj)


class DeltaNetBlock:
    """A linear-attention layer: its state, read from and written back to the plan's cache."""

    rope = "global"
    attention = None  # no keys and values: its cache slot holds a state instead

    def __init__(self, layer: Any, index: int, shape: DeltaNetShape, eps: float, feed_forward: Layer) -> None:
        self.index = index
        self.attention_norm = GemmaRMSNorm(layer.input_layernorm.weight, eps)
        self.mixer = mixer_weights(layer.linear_attn, shape)
        self.ffn_norm = GemmaRMSNorm(layer.post_attention_layernorm.weight, eps)
        self.feed_forward = feed_forward

    def __call__(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, plan: Plan) -> torch.Tensor:
        h = h + self._mix(self.attention_norm(h), plan)
        return h + self.feed_forward(self.ffn_norm(h))

    def _mix(self, x: torch.Tensor, plan: Plan) -> torch.Tensor:
        if isinstance(plan, SequencesStep):
            return self._mix_sequences(x, plan.steps)
        if not isinstance(plan, CausalChunk | ExactDecode | PerRowCheck):
            raise LlmcliError(
                f"the native engine has no fixed-shape (graphed) step for Qwen3.5 yet ({type(plan).__name__})"
            )
        cache: RecurrentCache = plan.cache  # type: ignore[assignment]
        start = plan.span - 1 if isinstance(plan, ExactDecode) else plan.start
        state = self._state_before(cache, start, x)
        if isinstance(plan, CausalChunk):
            out, state = prefill(self.mixer, x, state)
            cache.hold_state(self.index, state, start + x.shape[0])
            return out
        # The decode step, one row after another: each what it would give alone, and each row's
        # state kept until the next pass (a crop to the tokens a check accepts lands on it).
        rows, states = [], []
        for row in range(x.shape[0]):
            step, state = decode_step(self.mixer, x[row : row + 1], state)
            rows.append(step)
            states.append(state)
        if isinstance(plan, PerRowCheck):
            cache.hold_rows(self.index, states, start)
        else:
            cache.hold_state(self.index, state, start + 1)
        return torch.cat(rows)

    def _mix_sequences(self, x: torch.Tensor, steps: list[ExactDecode]) -> torch.Tensor:
        """One token of each of several sequences (row b of `x` steps[b]'s): their states, each
        from its own cache, as the rows of one, so the rule runs once for them all; row b is what
        its ExactDecode would give. Each cache keeps a copy of its row: a view would hold the
        whole stack alive for as long as that sequence waits."""
        caches: list[RecurrentCache] = [step.cache for step in steps]  # type: ignore[misc]
        starts = [step.span - 1 for step in steps]
        states = [self._state_before(cache, start, x) for cache, start in zip(caches, starts, strict=True)]
        out, stepped = decode_step(self.mixer, x, DeltaNetState.stack(states))
        for cache, start, state in zip(caches, starts, stepped.unstack(), strict=True):
            cache.hold_state(self.index, state.clone(), start + 1)
        return out

    def _state_before(self, cache: RecurrentCache, start: int, x: torch.Tensor) -> DeltaNetState:
        """The layer's state after the cache's first `start` tokens (zeros for a fresh sequence)."""
        state = cache.state_before(self.index, start)
        return state if state is not None else DeltaNetState.empty(self.mixer.shape, x.dtype, x.device)
