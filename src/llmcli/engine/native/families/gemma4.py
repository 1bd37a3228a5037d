"""Gemma 4 (`Gemma4ForCausalLM`, the text models).

    embedding × √hidden → per-layer inputs (E2B/E4B) → N × (norm → attention → norm, added;
    norm → GeGLU [+ experts] → norm, added; per-layer input, added; × layer scalar) → norm
    → logits, soft-capped

What differs from Gemma 3, settled here when the model is built:
- the layers' kinds differ in shape: a full layer has wider heads (`global_head_dim`) and may
  have fewer KV heads; each kind has its RoPE table (the full layers' "proportional": a quarter of
  each half of the head turned, the rest at frequency 0), and the cache a slot of its shape;
- KV sharing: the last `num_kv_shared_layers` layers compute no keys or values; each attends over
  the slot of the last layer of its kind before them, with that layer's keys and values of the
  same pass (gemma4_layout.kv_sources). One slot is written, several read, none allocated for a
  reading layer;
- `attention_k_eq_v`: a full layer's values are its keys' projection, normed without a scale;
- RMSNorms scale by the weight itself (not 1 + weight), attention scores are not scaled;
- per-layer inputs: a second embedding table and a projection of the embeddings give each layer
  a small input, gated by the residual stream and projected back into it;
- `enable_moe_block`: routed experts beside the dense MLP, each with its own norms, the router
  reading the residual stream;
- the logits soft-capped.
"""

from __future__ import annotations

import functools
from types import SimpleNamespace
from typing import Any

import torch
import torch.nn.functional as F

from llmcli.engine.native.attention import Attention
from llmcli.engine.native.families import llama
from llmcli.engine.native.families.base import NotSupported, Weights
from llmcli.engine.native.families.gemma3 import gemma_weights
from llmcli.engine.native.families.moe import CHECK_ROWS, SparseExperts
from llmcli.engine.native.layers import FeedForward, Shape, projection, rotate
from llmcli.models.gemma4_layout import SLIDING, BadLayout, kv_sources

ROPE_TYPES = frozenset({"default", "proportional"})
gelu = functools.partial(F.gelu, approximate="tanh")


def check_supported(model: Any, context_length: int) -> None:
    llama.check_supported(model, context_length)  # plain linear layers on one device
    config = model.config.get_text_config()
    if getattr(config, "use_bidirectional_attention", None) == "all":  # "vision": text stays causal
        raise NotSupported("bidirectional attention over all tokens")
    if getattr(config, "hidden_activation", None) != "gelu_pytorch_tanh":
        raise NotSupported(f"activation {getattr(config, 'hidden_activation', None)!r}")
    for kind, rope in (config.rope_parameters or {}).items():
        if rope.get("rope_type", "default") not in ROPE_TYPES:
            raise NotSupported(f"RoPE type {rope.get('rope_type')!r} for {kind} layers")
    try:
        kv_sources(config)
    except BadLayout as error:
        raise NotSupported(error.message) from None


class Gemma4Norm:
    """Gemma 4's RMSNorm: normalised in fp32, scaled by the weight (none: unscaled), rounded once."""

    def __init__(self, weight: torch.Tensor | None, eps: float, dtype: torch.dtype) -> None:
        self.scale = weight.float() if weight is not None else None
        self.eps, self.dtype = eps, dtype

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        return (normed * self.scale if self.scale is not None else normed).to(self.dtype)


class Gemma4Attention(Attention):
    """q (and k and v, where the layer computes them) from one projection; a reading layer's keys
    and values are those its source layer computed in this pass (`latest`), in the source's slot."""

    def __init__(
        self, attn: Any, shape: Shape, slot: int, window: int | None, dtype: torch.dtype, source: Any
    ) -> None:
        # Attention's constructor reads k_proj and v_proj, which a reading layer (and a layer
        # whose keys are its values) lacks: what the plans read of an attention is set here.
        self.layer, self.shape, self.window = slot, shape, window
        self.scale, self.sinks, self.softcap, self.scored = 1.0, None, None, False
        self.out = projection(attn.o_proj)
        self.q_norm = Gemma4Norm(attn.q_norm.weight, shape.eps, dtype)
        self.source: Gemma4Attention | None = source
        self.latest: tuple[torch.Tensor, torch.Tensor] | None = None
        if source is not None:
            self.qkv = projection(attn.q_proj)
            return
        v_proj = getattr(attn, "v_proj", None)
        self.keys_are_values = v_proj is None
        self.qkv = projection(attn.q_proj, attn.k_proj, *([] if v_proj is None else [v_proj]))
        self.k_norm = Gemma4Norm(attn.k_norm.weight, shape.eps, dtype)
        self.v_norm = Gemma4Norm(None, shape.eps, dtype)

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
        tokens, d = x.shape[0], self.shape.head_dim
        heads, kv_heads = self.shape.heads, self.shape.kv_heads
        qkv = self.qkv(x).view(tokens, -1, d)
        q = rotate(self.q_norm(qkv[:, :heads]), cos, sin).transpose(0, 1)
        if self.source is not None:
            assert self.source.latest is not None
            return (q, *self.source.latest)
        keys = qkv[:, heads : heads + kv_heads]
        values = keys if self.keys_are_values else qkv[:, heads + kv_heads :]
        k = rotate(self.k_norm(keys), cos, sin).transpose(0, 1)
        v = self.v_norm(values).transpose(0, 1)
        self.latest = (k, v)
        return q, k, v


class Gemma4Experts(SparseExperts):
    """The MoE block's experts: routed on the residual stream (normed, scaled per channel, each
    expert's weight scaled after the top-k's are renormalised), run on its own normed input,
    their gate through tanh-approximated gelu."""

    def __init__(self, layer: Any, top_k: int, eps: float, dtype: torch.dtype) -> None:
        router = layer.router
        # SparseExperts reads the router's rows for the experts' count and device only: this
        # router runs through its own projection (`route`), which --quant may have quantized.
        rows = router.per_expert_scale.view(-1, 1)
        super().__init__(
            SimpleNamespace(gate=SimpleNamespace(weight=rows, top_k=top_k), experts=layer.experts),
            normalise=True,
        )
        self.router_projection = projection(router.proj)
        self.router_scale = router.scale * router.proj.in_features**-0.5
        self.per_expert_scale = router.per_expert_scale
        self.router_norm = Gemma4Norm(None, eps, dtype)
        self.input_norm = Gemma4Norm(layer.pre_feedforward_layernorm_2.weight, eps, dtype)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores = self.router_projection(self.router_norm(x) * self.router_scale)
        weights, chosen = torch.topk(F.softmax(scores.float(), dim=-1), self.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        return (weights * self.per_expert_scale[chosen]).to(x.dtype), chosen

    def activate(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.split(self.intermediate, dim=-1)
        return gelu(gate) * up

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        """The residual stream h [T, hidden] → the experts' sum [T, hidden]."""
        weights, chosen = self.route(h)
        x = self.input_norm(h)
        if x.shape[0] <= CHECK_ROWS:
            return torch.cat([self._one(x[i], chosen[i], weights[i]) for i in range(x.shape[0])])
        return self._grouped(x, chosen, weights)


class PerLayerInputs:
    """Each layer's small input for a pass, [T, layers, width]: the token's row of a second
    embedding table (× √width) plus a normed projection of its embedding, over √2. Computed
    once a pass (Weights.before_blocks), read by every block (`current`)."""

    def __init__(self, body: Any, layers: int, eps: float, dtype: torch.dtype) -> None:
        self.table = body.embed_tokens_per_layer.weight
        self.width = body.per_layer_projection_norm.weight.shape[0]
        self.layers = layers
        self.table_scale = torch.tensor(self.width**0.5, dtype=self.table.dtype)
        self.projection = projection(body.per_layer_model_projection)
        self.projection_scale = body.per_layer_model_projection.in_features**-0.5
        self.norm = Gemma4Norm(body.per_layer_projection_norm.weight, eps, dtype)
        self.current: torch.Tensor | None = None

    def __call__(self, tokens: torch.Tensor, embedded: torch.Tensor) -> None:
        shape = (tokens.shape[0], self.layers, self.width)
        identity = (F.embedding(tokens, self.table) * self.table_scale.to(self.table.device)).view(shape)
        context = self.norm((self.projection(embedded) * self.projection_scale).view(shape))
        self.current = (context + identity) * 2**-0.5


class Gemma4Block:
    """Norms around attention and the feed-forward as Gemma 3's; the experts beside the MLP, the
    per-layer input after them, the whole layer scaled by its scalar."""

    def __init__(
        self,
        layer: Any,
        index: int,
        attention: Gemma4Attention,
        config: Any,
        inputs: PerLayerInputs | None,
        first_reader: bool,
    ) -> None:
        eps, dtype = config.rms_norm_eps, layer.input_layernorm.weight.dtype
        self.attention, self.index, self.dtype = attention, index, dtype
        self.rope = "local" if attention.window is not None else "global"

        def norm(name: str) -> Gemma4Norm:
            return Gemma4Norm(getattr(layer, name).weight, eps, dtype)

        self.attention_norm, self.after_attention = norm("input_layernorm"), norm("post_attention_layernorm")
        self.ffn_norm, self.after_feed_forward = (
            norm("pre_feedforward_layernorm"),
            norm("post_feedforward_layernorm"),
        )
        self.feed_forward = FeedForward(layer.mlp, gelu)
        self.experts = None
        if getattr(layer, "experts", None) is not None:
            self.experts = Gemma4Experts(layer, config.top_k_experts, eps, dtype)
            self.after_mlp, self.after_experts = (
                norm("post_feedforward_layernorm_1"),
                norm("post_feedforward_layernorm_2"),
            )
        self.inputs = inputs
        if inputs is not None:
            self.input_gate = projection(layer.per_layer_input_gate)
            self.input_projection = projection(layer.per_layer_projection)
            self.after_input = norm("post_per_layer_input_norm")
        self.scalar = layer.layer_scalar
        # The first layer reading another's KV: it and every layer after it (all reading) write no
        # keys or values, so a pass whose logits are its last row's carries that row alone on
        # (as transformers slices them): 20 of E2B's 35 layers run one row of a prompt, not all.
        self.last_row_on = first_reader

    def __call__(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, plan: Any) -> torch.Tensor:
        if self.last_row_on and plan.last_only:
            h = h[-1:]
        rows = h.shape[0]  # fewer than the pass's after the first reading layer
        cos, sin = cos[-rows:], sin[-rows:]
        attention = self.attention
        q, k, v = attention.project(self.attention_norm(h), cos, sin)
        h = h + self.after_attention(attention.out(plan.attend(attention, q, k, v)))
        out = self.feed_forward(self.ffn_norm(h))
        if self.experts is not None:
            out = self.after_mlp(out) + self.after_experts(self.experts(h.to(self.dtype)))
        h = h + self.after_feed_forward(out)
        if self.inputs is not None:
            assert self.inputs.current is not None
            gate = gelu(self.input_gate(h.to(self.dtype))) * self.inputs.current[-rows:, self.index]
            h = h + self.after_input(self.input_projection(gate))
        return h * self.scalar


def weights(model: Any, context_length: int) -> Weights:
    """The text model's weights: a Gemma4ForConditionalGeneration's language model (transformers'
    `model.language_model`) as a Gemma4ForCausalLM's."""
    config = model.config.get_text_config()
    body = getattr(model.model, "language_model", model.model)
    heads, eps = config.num_attention_heads, config.rms_norm_eps
    dtype = body.embed_tokens.weight.dtype
    kinds, sources = list(config.layer_types), kv_sources(config)
    inputs = None
    if getattr(body, "embed_tokens_per_layer", None) is not None:
        inputs = PerLayerInputs(body, config.num_hidden_layers, eps, dtype)
    slots: dict[int, int] = {}  # a layer computing keys and values → its cache slot
    attentions: list[Gemma4Attention] = []
    for index, layer in enumerate(body.layers):
        attn = layer.self_attn
        head_dim = attn.q_proj.out_features // heads
        window = config.sliding_window if kinds[index] == SLIDING else None
        source = sources[index]
        if source == index:
            slots[index] = len(slots)
            kv_heads = attn.k_proj.out_features // head_dim
            shape = Shape(0, heads, kv_heads, head_dim, eps)
            attentions.append(Gemma4Attention(attn, shape, slots[index], window, dtype, None))
        else:
            owner = attentions[source]
            attentions.append(Gemma4Attention(attn, owner.shape, owner.layer, window, dtype, owner))
    first_reader = next((i for i, source in enumerate(sources) if source != i), None)
    blocks = [
        Gemma4Block(layer, index, attentions[index], config, inputs, index == first_reader)
        for index, layer in enumerate(body.layers)
    ]
    first = attentions[0].shape
    shape = Shape(len(slots), heads, first.kv_heads, first.head_dim, eps)
    norm = Gemma4Norm(body.norm.weight, eps, dtype)
    return gemma_weights(body, config, model.lm_head, shape, blocks, norm, before_blocks=inputs)
