"""Qwen-VL's multimodal RoPE (Qwen2.5-VL, Qwen3-VL, Qwen3.5): each prompt row has three
positions — time, height, width. A text row's three are equal and one more than the row before;
an image's rows are laid out over its grid of merged patches, all starting where the text stopped,
and the text after it goes on from the image's largest extent, not from its row count.

Pure functions on torch tensors (no transformers), so the native engine can lay out a prompt's
positions and turn them into the cos/sin its attention rotates by. They follow transformers'
`get_rope_index` (modeling_qwen2_5_vl.py, modeling_qwen3_5.py: the same for still images) and its
text rotary embeddings (`recomposition_frequencies`) exactly.
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


def prompt_positions(
    length: int, images: Sequence[tuple[int, Grid]], start: int = 0
) -> tuple[torch.Tensor, int]:
    """The [3, length] positions of a prompt of `length` rows whose images begin at the given row
    offsets (each taking t·h·w consecutive rows, in order, not overlapping), the first row at
    position `start`; and the position the next token takes (the prompt's largest position + 1: a
    token generated after it sits there, and each one after that one further on)."""
    pieces, row, position = [], 0, start
    for offset, grid in sorted(images):
        count = grid[0] * grid[1] * grid[2]
        if offset < row or offset + count > length:
            raise ValueError(
                f"an image of {count} rows at row {offset} does not fit a prompt of {length} rows"
            )
        pieces.append(torch.arange(offset - row).expand(3, -1) + position)
        position += offset - row
        pieces.append(image_rows(position, grid))
        position += image_extent(grid)
        row = offset + count
    pieces.append(torch.arange(length - row).expand(3, -1) + position)
    position += length - row
    return torch.cat(pieces, dim=1), position


def image_runs(ids: Sequence[int], image_token_id: int, grids: Sequence[Grid]) -> list[tuple[int, Grid]]:
    """Where each image of a prompt begins: its rows are the runs of `image_token_id` in `ids`, the
    i-th run taking grids[i] (consecutive images are parted by their vision start/end tokens)."""
    starts = [i for i, token in enumerate(ids) if token == image_token_id and (i == 0 or ids[i - 1] != token)]
    if len(starts) != len(grids):
        raise ValueError(f"the prompt holds {len(starts)} images' tokens for {len(grids)} images")
    for start, grid in zip(starts, grids, strict=True):
        count = grid[0] * grid[1] * grid[2]
        end = start + count
        if end > len(ids) or any(token != image_token_id for token in ids[start:end]):
            raise ValueError(f"the image at row {start} has fewer than its grid's {count} tokens")
        if end < len(ids) and ids[end] == image_token_id:
            raise ValueError(f"the image at row {start} has more than its grid's {count} tokens")
    return list(zip(starts, grids, strict=True))


def rope_cos_sin(
    positions: torch.Tensor,
    inv_freq: torch.Tensor,
    mrope_section: Sequence[int],
    interleaved: bool,
    attention_scaling: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [T, 2·len(inv_freq)] (fp32) for [3, T] positions: each frequency takes the
    angle of one of the three positions. Interleaved (Qwen3-VL, Qwen3.5): frequency i follows
    height where i % 3 == 1 and width where i % 3 == 2, within 3·section of each, time elsewhere;
    chunked (Qwen2.5-VL): the first section[0] frequencies follow time, the next section[1] height,
    the rest width. Both halves of a head take the same angles (rotate_half's layout)."""
    angles = positions.to(torch.float32)[..., None] * inv_freq.to(
        device=positions.device, dtype=torch.float32
    )
    if interleaved:
        chosen = angles[0].clone()
        for axis in (1, 2):
            picked = slice(axis, mrope_section[axis] * 3, 3)
            chosen[..., picked] = angles[axis, ..., picked]
    else:
        chunks = angles.split(list(mrope_section), dim=-1)
        chosen = torch.cat([chunk[i % 3] for i, chunk in enumerate(chunks)], dim=-1)
    doubled = torch.cat((chosen, chosen), dim=-1)
    return doubled.cos() * attention_scaling, doubled.sin() * attention_scaling
