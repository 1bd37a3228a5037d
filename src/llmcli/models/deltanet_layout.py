"""A Gated DeltaNet layer's tensors as a checkpoint stores them (Qwen3.5, Qwen3-Next), torch-free:
their names, so the lean loader reads them and the loader's checks can find one missing before
any weight is read."""

from __future__ import annotations

from llmcli.models.families import Family

# Qwen3.5's four input projections; Qwen3-Next's two, their rows grouped per key head.
_PROJECTIONS = ("in_proj_qkv.weight", "in_proj_z.weight", "in_proj_b.weight", "in_proj_a.weight")
_GROUPED_PROJECTIONS = ("in_proj_qkvz.weight", "in_proj_ba.weight")
# What every layout has: the convolution, the state's decay and step size, the gated norm.
_STATE_AND_OUTPUT = ("conv1d.weight", "dt_bias", "A_log", "norm.weight", "out_proj.weight")


def deltanet_tensors(row: Family) -> tuple[str, ...]:
    """A linear-attention layer's tensor names under its `linear_attn.`, as `row` stores them."""
    projections = _GROUPED_PROJECTIONS if row.grouped_deltanet_projections else _PROJECTIONS
    return projections + _STATE_AND_OUTPUT
