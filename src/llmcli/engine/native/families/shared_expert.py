"""A mixture of experts with a shared expert (Qwen3.5-MoE, Qwen3-Next): the routed experts as
the MoE family runs them (moe.SparseExperts), plus one gated MLP every token goes through, its
output scaled by a per-token sigmoid gate (`shared_expert_gate`, one row), as transformers'
`…SparseMoeBlock` adds them."""

from __future__ import annotations

from typing import Any

import torch

from llmcli.engine.native.families.moe import SparseExperts
from llmcli.engine.native.layers import FeedForward, projection


class SharedExpertMoE:
    def __init__(self, mlp: Any, normalise: bool) -> None:
        self.routed = SparseExperts(mlp, normalise)
        self.shared = FeedForward(mlp.shared_expert)
        self.shared_gate = projection(mlp.shared_expert_gate)  # [hidden] → one logit per token

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] → [T, hidden]."""
        return self.routed(x) + torch.sigmoid(self.shared_gate(x)) * self.shared(x)


def feed_forward(mlp: Any, normalise: bool) -> Any:
    """A layer's feed-forward: the experts and their shared one where the layer is sparse (it has
    a router), else its dense gated MLP (Qwen3-Next's `mlp_only_layers`)."""
    return SharedExpertMoE(mlp, normalise) if hasattr(mlp, "experts") else FeedForward(mlp)
