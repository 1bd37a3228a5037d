"""Sparse mixtures of experts: Qwen3-MoE and Mixtral.

    embedding → N × (RMSNorm → attention → RMSNorm → router → the top-k experts' gated MLPs,
    weighted) → norm → logits

Attention, norms and RoPE are the Llama family's (Qwen3-MoE's q/k norms included), so the blocks
come from there; what differs is the feed-forward of a sparse layer. transformers stores each
layer's experts stacked: gate and up as one [experts, 2 × intermediate, hidden] tensor, down as
[experts, hidden, intermediate]; the router is one [experts, hidden] matrix. The weights read are
those tensors themselves.

A token's step reads only its k experts. On a CPU each is used where it lies, by its index read
on the host (free there): gathering them first would copy k experts' weights every step, which
measured slower than transformers' own loop. On a GPU the experts are chosen on the device (no
host sync, so a CUDA graph can replay it; k is fixed per model) and a kernel of llmcli's own reads
each chosen expert where it lies (gathered_cuda.py); another accelerator copies their slices
first. A longer pass groups its tokens by expert and runs each expert once over its tokens, as transformers
does. Up to CHECK_ROWS rows take the one-token path row by row, so the experts of a speculative
check row are computed as the decode step it stands for computes them.

Layers that stay dense (Qwen3-MoE's `mlp_only_layers`, a `decoder_sparse_step` above 1) keep the
Llama family's gated MLP.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from llmcli.engine.native.families import llama
from llmcli.engine.native.families.base import Layer, NotSupported, Weights
from llmcli.engine.native.layers import FeedForward

# Passes of at most this many rows run each row as a decode step would (speculative checks,
# short chat turns); longer ones group their tokens by expert.
CHECK_ROWS = 16


def check_supported(model: Any, context_length: int) -> None:
    llama.check_supported(model, context_length)
    check_stacked_experts(model)
    if any(getattr(layer.mlp, "shared_expert", None) is not None for layer in model.model.layers):
        raise NotSupported("a shared expert beside the routed ones")


def check_stacked_experts(model: Any) -> None:
    """Raise NotSupported unless each sparse layer's experts are what SparseExperts reads: stacked
    tensors (or llmcli's quantized layers) behind a silu."""
    config = model.config
    for index, layer in enumerate(model.model.layers):
        experts = getattr(layer.mlp, "experts", None)
        if experts is None or quantized_layers(experts, check=True):
            continue
        for name in ("gate_up_proj", "down_proj"):
            tensor = getattr(experts, name, None)
            if not isinstance(tensor, torch.Tensor) or tensor.dim() != 3:
                raise NotSupported(f"layer {index}'s experts are not stacked tensors ({name})")
    if getattr(config, "hidden_act", "silu") != "silu":
        raise NotSupported(f"expert activation {config.hidden_act!r}")


def weights(model: Any, context_length: int) -> Weights:
    config = model.config
    # Mixtral always renormalises the top-k weights; Qwen3-MoE says whether it does.
    normalise = bool(getattr(config, "norm_topk_prob", True))

    def feed_forward(layer: Any, index: int) -> Layer:
        mlp = layer.mlp
        return SparseExperts(mlp, normalise) if hasattr(mlp, "experts") else FeedForward(mlp)

    return llama.weights(model, context_length, feed_forward)


def expert_products(stacked: torch.Tensor, chosen: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """stacked [experts, N, K] (a transposed view too), chosen [k] on the device, x [K] (the same
    input for each) or [k, K] → [k, N], row s being stacked[chosen[s]] @ x[s]. On CUDA the experts
    are read where they lie (gathered_cuda.py); elsewhere their slices are copied first."""
    if stacked.is_cuda:
        from llmcli.engine.native.gathered_cuda import gathered_matvec

        return gathered_matvec(stacked, chosen, x)
    inputs = x.expand(chosen.shape[0], -1).unsqueeze(-1)
    return torch.matmul(stacked.index_select(0, chosen), inputs).squeeze(-1)


def quantized_layers(experts: Any, check: bool = False) -> tuple[Any, Any] | None:
    """Each expert's quantized gate/up and down layers, where `--quant` made them (models/
    quantized.py). `check`: raise NotSupported for such layers off a CPU, since a GPU's decode
    step gathers its experts by index, which needs a gathered int8/int4 kernel."""
    gate_up = getattr(experts, "_llmcli_gate_up", None)
    if gate_up is None:
        return None
    if check and gate_up[0].packed.device.type != "cpu":
        raise NotSupported("int8/int4 experts off a CPU (a GPU needs a gathered kernel for them)")
    return gate_up, experts._llmcli_down


class SparseExperts:
    """A router and stacked experts: each token through its top-k experts' gated MLPs, their
    outputs weighted by the router's (renormalised) probabilities. Another family's experts
    (gpt-oss) change `route`, `dense_gate_up`, `dense_down`, `activate` and `gathered`; how
    tokens reach them stays.
    Experts quantized one by one (`--quant` on a CPU: models/quantized.py) run through their
    own int8/int4 layers, biases included."""

    def __init__(self, mlp: Any, normalise: bool) -> None:
        experts = mlp.experts
        self.router = mlp.gate.weight  # [experts, hidden]
        self.gate_up = experts.gate_up_proj  # [experts, 2 × intermediate, hidden]
        self.down = experts.down_proj  # [experts, hidden, intermediate]
        self.top_k = mlp.gate.top_k
        self.normalise = normalise
        self.experts = self.router.shape[0]
        self.quantized = quantized_layers(experts)
        self.intermediate = self.quantized[1][0].in_features if self.quantized else self.down.shape[-1]
        self.on_host = self.router.device.type == "cpu"

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, hidden] → each token's expert weights [T, k] (in x's dtype) and experts [T, k]."""
        probs = F.softmax(F.linear(x, self.router).float(), dim=-1)
        weights, chosen = torch.topk(probs, self.top_k, dim=-1)
        if self.normalise:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype), chosen

    def expert(self, x: torch.Tensor, expert: int) -> torch.Tensor:
        """Tokens x [n, hidden] (or one, [hidden]) through one expert, used where it lies: its
        quantized layers where --quant made them, else its slices of the stacked tensors."""
        if self.quantized:
            gate_up, down = self.quantized
            return down[expert](self.activate(gate_up[expert](x)))
        return self.dense_down(self.activate(self.dense_gate_up(x, expert)), expert)

    def activate(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.split(self.intermediate, dim=-1)
        return F.silu(gate) * up

    def dense_gate_up(self, x: torch.Tensor, expert: int) -> torch.Tensor:
        return F.linear(x, self.gate_up[expert])

    def dense_down(self, hidden: torch.Tensor, expert: int) -> torch.Tensor:
        return F.linear(hidden, self.down[expert])

    def gathered(self, x: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
        """One token [hidden] through its k experts chosen on the device: [k, hidden]."""
        hidden = self.activate(expert_products(self.gate_up, chosen, x))
        return expert_products(self.down, chosen, hidden)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] → [T, hidden]."""
        weights, chosen = self.route(x)
        if x.shape[0] <= CHECK_ROWS:
            return torch.cat([self._one(x[i], chosen[i], weights[i]) for i in range(x.shape[0])])
        return self._grouped(x, chosen, weights)

    def _one(self, x: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """One token [hidden] through its k experts: only their weights are read. [1, hidden]."""
        if self.on_host:
            out = None
            for slot, expert in enumerate(chosen.tolist()):
                y = self.expert(x, expert) * weights[slot]
                out = y if out is None else out + y
            return out[None]
        return (self.gathered(x, chosen) * weights[:, None]).sum(dim=0, keepdim=True)

    def _grouped(self, x: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Many tokens: each expert once, over the tokens that chose it."""
        out = torch.zeros_like(x)
        flat = chosen.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.experts).tolist()  # one sync per layer and pass
        flat_weights = weights.reshape(-1)
        start = 0
        for expert, count in enumerate(counts):
            if not count:
                continue
            picks = order[start : start + count]
            start += count
            tokens = picks // self.top_k
            out.index_add_(0, tokens, self.expert(x[tokens], expert) * flat_weights[picks, None])
        return out
