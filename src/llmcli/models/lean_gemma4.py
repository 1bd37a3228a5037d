"""A Gemma 4 text checkpoint's layers and per-layer input embeddings in the module layout of
transformers' Gemma4TextModel (the names the native family reads), from the safetensors alone.

Beside the Gemma layout lean_model.py builds: a layer that reads another's keys and values has
no k/v projections or their norms; a full layer whose keys are its values (`attention_k_eq_v`)
has no v_proj; each layer has a `layer_scalar`, the per-layer input gate and projection where the
config has per-layer embeddings, and the router, stacked experts and their norms where
`enable_moe_block`. Which tensors a config implies is gemma4_layout.expected_tensors; here they
are read.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn

from llmcli.models.gemma4_layout import keys_are_values, kv_sources
from llmcli.models.lean_config import LeanConfig
from llmcli.models.lean_modules import Norm
from llmcli.models.lean_modules import fits_the_stream as _fits_the_stream
from llmcli.models.lean_modules import linear as _linear


class TensorSource(Protocol):
    """What is read here of lean_model.TensorSource (which imports this module to build)."""

    def get(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor: ...


def build_layers(tensors: TensorSource, config: LeanConfig, body: nn.Module) -> None:
    """The layers onto `body`, and the per-layer input embeddings where the config has them."""
    sources = kv_sources(config)
    body.layers = nn.ModuleList(
        _layer(tensors, f"model.layers.{i}", config, kind, sources[i] == i)
        for i, kind in enumerate(config.layer_types)
    )
    if config.hidden_size_per_layer_input:
        body.embed_tokens_per_layer = nn.Embedding.from_pretrained(
            tensors.get("model.embed_tokens_per_layer.weight"), freeze=True
        )
        body.per_layer_model_projection = _linear(
            tensors.get("model.per_layer_model_projection.weight"), None
        )
        body.per_layer_projection_norm = Norm(tensors.get("model.per_layer_projection_norm.weight"))


def _parameter(module: nn.Module, name: str, tensors: TensorSource, tensor: str) -> None:
    module.register_parameter(name, nn.Parameter(tensors.get(tensor), requires_grad=False))


def _layer(tensors: TensorSource, prefix: str, config: LeanConfig, kind: str, computes_kv: bool) -> nn.Module:
    def linear(name: str, on_stream: bool = True) -> nn.Linear:
        weight = tensors.get(f"{prefix}.{name}.weight")
        if on_stream:
            _fits_the_stream(f"{prefix}.{name}.weight", weight, config.hidden_size)
        return _linear(weight, None)

    def norms(module: nn.Module, *names: str) -> None:
        for name in names:
            setattr(module, name, Norm(tensors.get(f"{prefix}.{name}.weight")))

    layer = nn.Module()
    norms(
        layer, "input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
        "post_feedforward_layernorm",
    )  # fmt: skip
    _parameter(layer, "layer_scalar", tensors, f"{prefix}.layer_scalar")
    attention = nn.Module()
    names = ["q_proj", "o_proj"]
    if computes_kv:
        names += ["k_proj"] if keys_are_values(config, kind) else ["k_proj", "v_proj"]
    for name in names:
        setattr(attention, name, linear(f"self_attn.{name}"))
    norms_of = ("q_norm", "k_norm") if computes_kv else ("q_norm",)
    for name in norms_of:
        setattr(attention, name, Norm(tensors.get(f"{prefix}.self_attn.{name}.weight")))
    layer.self_attn = attention
    mlp = nn.Module()
    for name in ("gate_proj", "up_proj", "down_proj"):
        setattr(mlp, name, linear(f"mlp.{name}"))
    layer.mlp = mlp
    if config.hidden_size_per_layer_input:
        layer.per_layer_input_gate = linear("per_layer_input_gate")
        layer.per_layer_projection = linear("per_layer_projection", on_stream=False)
        norms(layer, "post_per_layer_input_norm")
    if config.enable_moe_block:
        router, experts = nn.Module(), nn.Module()
        router.proj = linear("router.proj")
        for name in ("scale", "per_expert_scale"):
            _parameter(router, name, tensors, f"{prefix}.router.{name}")
        for name in ("gate_up_proj", "down_proj"):
            _parameter(experts, name, tensors, f"{prefix}.experts.{name}")
        layer.router, layer.experts = router, experts
        norms(
            layer,
            "post_feedforward_layernorm_1",
            "post_feedforward_layernorm_2",
            "pre_feedforward_layernorm_2",
        )
    return layer
