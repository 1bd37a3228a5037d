"""The plain modules a lean model is made of (lean_model.py, lean_gemma4.py): a norm's weight and
a linear layer around given tensors, and the check that a projection fits the residual stream."""

from __future__ import annotations

import torch
from torch import nn

from llmcli.models.lean_config import DamagedCheckpoint


class Norm(nn.Module):
    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)


def linear(weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Linear:
    """An nn.Linear around these tensors. Its constructor is skipped: it would initialise random
    weights first, and on the meta device that imports torch's compiler (1.2 s, measured)."""
    layer = nn.Linear.__new__(nn.Linear)
    nn.Module.__init__(layer)
    layer.out_features, layer.in_features = weight.shape
    layer.weight = nn.Parameter(weight, requires_grad=False)
    layer.bias = nn.Parameter(bias, requires_grad=False) if bias is not None else None
    return layer


# The projections that write the residual stream (their rows are the hidden size); every other
# one reads it (its columns are).
_WRITERS = frozenset({"o_proj", "down_proj", "w2", "out_proj"})


def fits_the_stream(name: str, weight: torch.Tensor, hidden: int) -> None:
    """A projection whose side facing the residual stream is not the hidden size: the checkpoint
    does not match its config, which transformers' path names in one line (DamagedCheckpoint)."""
    projection = name.removesuffix(".weight").rsplit(".", 1)[-1]
    side = weight.shape[-2] if projection in _WRITERS else weight.shape[-1]
    if side != hidden:
        raise DamagedCheckpoint(f"a checkpoint whose tensor {name} has the shape {list(weight.shape)}")
