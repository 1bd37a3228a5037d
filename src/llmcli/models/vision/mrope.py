"""Qwen-VL's multimodal RoPE (Qwen2.5-VL, Qwen3-VL, Qwen3.5): each prompt row has three
positions — time, height, width. A text row's three are equal and one more than the row before;
an image's rows are laid out over its grid of merged patches, all starting where the text stopped,
and the text after it goes on from the image's largest extent, not from its row count.

Pure functions on torch tensors (no transformers): the native engine lays an image's rows out
with them (engine/image_rows.py) and turns each frequency by its axis (`mrope_axes`). They
follow transformers' `get_rope_index` (modeling_qwen2_5_vl.py, modeling_qwen3_5.py: the same for
still images) and its text rotary embeddings exactly.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

Grid = tuple[int, int, int]  # an image's (time, height, width) in merged patches: Placeholder.grid


def image_rows(start: int, grid: Grid) -> torch.Tensor:
    """The [3, t·h·w] positions of an image whose grid begins at position `start`: time, row and
    column each counted from `start`, in the order the vision tower emits its rows (row-major)."""
    t, h, w = grid
    time, height, width = torch.meshgrid(torch.arange(t), torch.arange(h), torch.arange(w), indexing="ij")
    return torch.stack([time, height, width]).reshape(3, -1) + start


def image_extent(grid: Grid) -> int:
    """How far an image moves the position the text after it takes: its larger side, whatever its
    row count (transformers advances by max(h, w) for a still image)."""
    return max(grid[1], grid[2])


def mrope_axes(section: Sequence[int], frequencies: int, interleaved: bool) -> torch.Tensor:
    """The axis (0 time, 1 height, 2 width) each of `frequencies` RoPE frequencies turns by.
    Interleaved (Qwen3-VL, Qwen3.5): frequency i follows height where i % 3 == 1 and width where
    i % 3 == 2, within 3·section of each, time elsewhere; chunked (Qwen2.5-VL): the first
    section[0] frequencies follow time, the next section[1] height, the rest width."""
    axes = torch.zeros(frequencies, dtype=torch.long)
    if interleaved:
        for axis in (1, 2):
            axes[axis : section[axis] * 3 : 3] = axis
    else:
        axes[section[0] : section[0] + section[1]] = 1
        axes[section[0] + section[1] :] = 2
    return axes


def rope_cos_sin(
    positions: torch.Tensor,
    inv_freq: torch.Tensor,
    mrope_section: Sequence[int],
    interleaved: bool,
    attention_scaling: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [T, 2·len(inv_freq)] (fp32) for [3, T] positions: each frequency takes the
    angle of one of the three positions (`mrope_axes`), as the native forward turns them
    (Transformer.rope); both halves of a head take the same angles (rotate_half's layout)."""
    axes = mrope_axes(mrope_section, inv_freq.shape[0], interleaved).to(positions.device)
    chosen = positions.to(torch.float32)[axes].T * inv_freq.to(device=positions.device, dtype=torch.float32)
    doubled = torch.cat((chosen, chosen), dim=-1)
    return doubled.cos() * attention_scaling, doubled.sin() * attention_scaling
