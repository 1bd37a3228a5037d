"""gpt-oss (`GptOssForCausalLM`).

    embedding → N × (RMSNorm → attention with sinks → RMSNorm → router → the top-k experts'
    clamped SwiGLU, weighted) → norm → logits

The Llama family's blocks, with what differs settled when the model is built:
- attention with biases on q/k/v/o and a learned sink logit per head (attention.py);
- sliding-window layers (128) alternating with full ones, as its `layer_types` say, the sliding
  layers' KV cache a ring of the window;
- YaRN RoPE, read from transformers' own table (static for a load);
- the norms' weights kept in fp32 beside an fp16 model, as transformers keeps them there
  (RMSNorm scales in fp32, then rounds);
- experts with biases, gate and up interleaved in one stacked [experts, hidden, 2 × intermediate]
  tensor (transposed from Qwen3-MoE's), through a clamped SwiGLU: gate clamped above at
  `swiglu_limit`, up to ±limit, gate·σ(α·gate)·(up + 1);
- a router with a bias, softmax over the top-k logits only.

The released checkpoints store experts in MXFP4. On a CPU llmcli's lean loader dequantizes them
(models/mxfp4.py), as transformers does where it has no kernel (`Mxfp4Config(dequantize=True)`),
and the experts are then plain tensors this module reads; experts left packed in MXFP4 blocks
(transformers' kernel, on a GPU) are refused by `check_supported` with the reason, and
`--engine auto` falls back to transformers.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from llmcli.engine.native.families import llama, moe
from llmcli.engine.native.families.base import Layer, NotSupported, Weights

STACKED = ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")


def check_supported(model: Any, context_length: int) -> None:
    llama.check_supported(model, context_length)
    for index, layer in enumerate(model.model.layers):
        experts = layer.mlp.experts
        if moe.quantized_layers(experts, check=True):
            continue
        for name in STACKED:
            tensor = getattr(experts, name, None)
            if not isinstance(tensor, torch.Tensor) or not tensor.is_floating_point():
                raise NotSupported(
                    f"layer {index}'s experts are not dequantized tensors ({name}: MXFP4 blocks)"
                )


def weights(model: Any, context_length: int) -> Weights:
    def feed_forward(layer: Any, index: int) -> Layer:
        return ClampedSwigluExperts(layer.mlp, model.config)

    return llama.weights(model, context_length, feed_forward)


class ClampedSwigluExperts(moe.SparseExperts):
    """gpt-oss's router and experts, reached as every sparse layer's are (moe.SparseExperts)."""

    def __init__(self, mlp: Any, config: Any) -> None:
        experts = mlp.experts
        self.router = mlp.router.weight  # [experts, hidden]
        self.router_bias = mlp.router.bias
        self.gate_up = experts.gate_up_proj  # [experts, hidden, 2 × intermediate], gate/up interleaved
        self.gate_up_bias = experts.gate_up_proj_bias  # [experts, 2 × intermediate]
        self.down = experts.down_proj  # [experts, intermediate, hidden]
        self.down_bias = experts.down_proj_bias  # [experts, hidden]
        self.top_k = mlp.router.top_k
        self.experts = self.router.shape[0]
        self.quantized = moe.quantized_layers(experts)
        self.intermediate = self.quantized[1][0].in_features if self.quantized else self.down.shape[1]
        # transformers before 5.2x has neither field and computes with the released 1.702 and 7.
        self.alpha = float(getattr(config, "swiglu_alpha", 1.702))
        self.limit = float(getattr(config, "swiglu_limit", 7.0))
        self.on_host = self.router.device.type == "cpu"

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = F.linear(x, self.router, self.router_bias)
        top, chosen = torch.topk(logits, self.top_k, dim=-1)
        return F.softmax(top, dim=-1), chosen

    def activate(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate = gate_up[..., ::2].clamp(max=self.limit)
        up = gate_up[..., 1::2].clamp(min=-self.limit, max=self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))

    def dense_gate_up(self, x: torch.Tensor, expert: int) -> torch.Tensor:
        return torch.matmul(x, self.gate_up[expert]) + self.gate_up_bias[expert]

    def dense_down(self, hidden: torch.Tensor, expert: int) -> torch.Tensor:
        return torch.matmul(hidden, self.down[expert]) + self.down_bias[expert]

    def gathered(self, x: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
        # Stored [experts, in, out]: the products take them as [experts, out, in] views.
        gate_up = moe.expert_products(self.gate_up.transpose(1, 2), chosen, x)  # [k, 2 × intermediate]
        hidden = self.activate(gate_up + self.gate_up_bias.index_select(0, chosen))
        out = moe.expert_products(self.down.transpose(1, 2), chosen, hidden)
        return out + self.down_bias.index_select(0, chosen)
