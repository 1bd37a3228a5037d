"""A Gated DeltaNet layer's tensors as a checkpoint stores them (Qwen3.5, Qwen3-Next), torch-free:
their names, which the lean loader reads, and the shapes the config's settings give them, which
the loader checks from the files' headers before any weight is read (a tensor missing, or a
convolution width or state size the config contradicts, named in one line)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from llmcli.errors import ModelLoadError
from llmcli.models.families import Family

if TYPE_CHECKING:
    from llmcli.models.headers import TensorHeader

# Qwen3.5's four input projections; Qwen3-Next's two, their rows grouped per key head.
_PROJECTIONS = ("in_proj_qkv.weight", "in_proj_z.weight", "in_proj_b.weight", "in_proj_a.weight")
_GROUPED_PROJECTIONS = ("in_proj_qkvz.weight", "in_proj_ba.weight")
# What every layout has: the convolution, the state's decay and step size, the gated norm.
_STATE_AND_OUTPUT = ("conv1d.weight", "dt_bias", "A_log", "norm.weight", "out_proj.weight")


def deltanet_tensors(row: Family) -> tuple[str, ...]:
    """A linear-attention layer's tensor names under its `linear_attn.`, as `row` stores them."""
    projections = _GROUPED_PROJECTIONS if row.grouped_deltanet_projections else _PROJECTIONS
    return projections + _STATE_AND_OUTPUT


# The settings each dimension of a layer's tensors follows, as the message names them.
_CHANNELS = "linear_num_key_heads, linear_key_head_dim, linear_num_value_heads and linear_value_head_dim"
_VALUES = "linear_num_value_heads and linear_value_head_dim"
_VALUE_HEADS = "linear_num_value_heads"
_HIDDEN = "hidden_size"
_HINT = "the checkpoint is damaged or not for this config.json: download it again"


def check_layers(shapes: Mapping[str, TensorHeader], config: Any, row: Family, body: str = "model") -> None:
    """Raise ModelLoadError, in one line naming the tensor and the setting, where a linear-attention
    layer of `config` (a LeanConfig) lacks one of its tensors or has one of a shape its settings
    contradict (a convolution width, a state size, a head count): from the checkpoint's headers
    (`shapes`), before any weight is read."""
    key_heads, value_heads = config.linear_num_key_heads, config.linear_num_value_heads
    if value_heads % key_heads:
        raise ModelLoadError(
            f"its config's linear_num_value_heads ({value_heads}) is not a multiple of its "
            f"linear_num_key_heads ({key_heads})",
            _HINT,
        )
    wanted = _wanted_shapes(config)
    for index, kind in enumerate(config.layer_types):
        if kind != "linear_attention":
            continue
        layer = f"{body}.layers.{index}.linear_attn"
        names = deltanet_tensors(row)
        if missing := [name for name in names if f"{layer}.{name}" not in shapes]:
            raise ModelLoadError(  # as transformers' path says it (libraries.py), before any weight
                f"the checkpoint lacks the tensor {layer}.{missing[0]} that its config's architecture needs",
                "the checkpoint is incomplete or not for this config: download it again",
            )
        for name in (name for name in wanted if name in names):  # one setting's tensors first
            stored = f"{layer}.{name}"
            _check_shape(stored, list(shapes[stored].shape), wanted[name])


def _wanted_shapes(config: Any) -> dict[str, list[tuple[int, str]]]:
    """Each tensor's dimensions as the config's settings give them, with the settings' names."""
    key_dim = config.linear_num_key_heads * config.linear_key_head_dim
    value_dim = config.linear_num_value_heads * config.linear_value_head_dim
    heads = config.linear_num_value_heads
    channels, hidden = (2 * key_dim + value_dim, _CHANNELS), (config.hidden_size, _HIDDEN)
    return {  # those whose every dimension is one setting's first: the message names it
        "dt_bias": [(heads, _VALUE_HEADS)],
        "A_log": [(heads, _VALUE_HEADS)],
        "norm.weight": [(config.linear_value_head_dim, "linear_value_head_dim")],
        "in_proj_qkv.weight": [channels, hidden],
        "in_proj_z.weight": [(value_dim, _VALUES), hidden],
        "in_proj_b.weight": [(heads, _VALUE_HEADS), hidden],
        "in_proj_a.weight": [(heads, _VALUE_HEADS), hidden],
        "in_proj_qkvz.weight": [(2 * key_dim + 2 * value_dim, _CHANNELS), hidden],
        "in_proj_ba.weight": [(2 * heads, _VALUE_HEADS), hidden],
        "conv1d.weight": [
            channels,
            (1, "a depthwise convolution (one input per channel)"),
            (config.linear_conv_kernel_dim, "linear_conv_kernel_dim"),
        ],
        "out_proj.weight": [hidden, (value_dim, _VALUES)],
    }


def _check_shape(name: str, shape: list[int], wanted: list[tuple[int, str]]) -> None:
    expected = [size for size, _ in wanted]
    if shape == expected:
        return
    settings = [setting for (size, setting), actual in zip(wanted, shape, strict=False) if size != actual]
    because = f" ({settings[0]})" if settings else ""
    raise ModelLoadError(
        f"the checkpoint's tensor {name} has the shape {shape}, where its config{because} says {expected}",
        _HINT,
    )
