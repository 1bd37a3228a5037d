"""The pieces a native block is made of, in the model's own dtype: RMSNorm, the gated feed-
forward, RoPE, and linear projections over fused weights (q/k/v as one matrix, gate/up as one)
or llmcli's quantized layers. Families (families/) assemble blocks from them."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F


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

    A weight kept in fp32 beside a bf16 model (gpt-oss keeps its norms so) scales in fp32, and
    the result is rounded to `dtype`, what the next matrix product takes.
    """

    def __init__(self, weight: torch.Tensor, eps: float, dtype: torch.dtype | None = None) -> None:
        self.weight = weight
        self.eps = eps
        self.dtype = dtype or weight.dtype
        self.fused = weight.device.type == "cuda" and self.dtype == weight.dtype

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused:
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        # A CPU's residual stream is fp32 already (forward.py): no cast to dispatch then.
        normed = F.rms_norm(x if x.dtype == torch.float32 else x.float(), (x.shape[-1],), eps=self.eps)
        if self.dtype != self.weight.dtype:
            return (self.weight.float() * normed).to(self.dtype)
        return self.weight * normed.to(self.weight.dtype)


class FeedForward:
    """A gated MLP, down(act(gate(x)) · up(x)), with gate and up as one matrix: SwiGLU (silu),
    or GeGLU (Gemma's tanh-approximated gelu)."""

    def __init__(self, mlp: Any, activation: Callable[[torch.Tensor], torch.Tensor] = F.silu) -> None:
        self.activation = activation
        # Phi-3 stores gate and up fused in its checkpoint already.
        fused = getattr(mlp, "gate_up_proj", None)
        self.gate_up = projection(fused) if fused is not None else projection(mlp.gate_proj, mlp.up_proj)
        self.down = projection(mlp.down_proj)
        self.intermediate = mlp.down_proj.in_features

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).split(self.intermediate, dim=-1)
        return self.down(self.activation(gate) * up)


def rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """RoPE as transformers applies it, x·cos + rotate_half(x)·sin, with rotate_half's minus
    sign folded into `signed_sin` (−sin on the first half): three kernels, not five. With a
    partial rotary factor (Phi-4-mini) cos and sin are narrower than a head: the dimensions
    past them pass unrotated."""
    width = cos.shape[-1]
    if width < x.shape[-1]:
        return torch.cat((rotate(x[..., :width], cos, signed_sin), x[..., width:]), dim=-1)
    half = width // 2
    swapped = torch.cat((x[..., half:], x[..., :half]), dim=-1)
    return torch.addcmul(x * cos, swapped, signed_sin)


def identity(x: torch.Tensor) -> torch.Tensor:
    return x


def projection(*linears: Any) -> Callable[[torch.Tensor], torch.Tensor]:
    """x → the outputs of `linears`, concatenated. Dense layers become one matrix product over
    their fused weights; quantized ones (their packed formats do not concatenate) run in turn."""
    if all(type(linear) is torch.nn.Linear for linear in linears):
        if len(linears) == 1:
            return functools.partial(F.linear, weight=linears[0].weight, bias=linears[0].bias)
        return functools.partial(F.linear, weight=fuse(*linears), bias=_fuse_bias(*linears))
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


def fuse(*linears: Any) -> torch.Tensor:
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
