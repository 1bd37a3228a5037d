"""The cache of a model with linear-attention layers (Qwen3.5's Gated DeltaNet): keys and values
for its full-attention layers, as any KV cache (kvcache.py), and for each linear layer the
recurrent state it has after the tokens held.

A recurrent state folds every token in: it cannot be cropped back to a shorter prefix. So the
cache keeps checkpoints, the linear layers' states at some lengths, and a crop goes back to the
last one at or before the length asked (what lies between runs again; the caller is told the
length kept, as after a ring's crop). The backend takes them during a prefill (backend.py):
- where the text held so far ends, before the new tokens (the end of a reply: chat's `/undo`
  goes back there, and a rewritten template parts from the text there or later);
- every CHECKPOINT_INTERVAL positions (a long system prompt shared by later prompts);
- where the prompt ends (chat's `/retry` and the server's next request from the same
  conversation go back there).
At most MAX_CHECKPOINTS are kept per sequence, the closest together thinned first; their memory
counts in `bytes_for` and, set aside with the cache, in the prefix store's budget.

A speculative check (plans.PerRowCheck) keeps each row's states until the next pass, so the
crop to the accepted tokens lands exactly on them rather than on an earlier checkpoint.

States are never written into (gated_deltanet.py returns new ones), so a checkpoint is the state
itself, not a copy, and the host copy of a CPU cache shares them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from llmcli.engine.native.gated_deltanet import DeltaNetState
from llmcli.engine.native.kvcache import KVCache, SavedCache, bytes_of

# Positions between checkpoints during a prefill: the most a prompt sharing a long prefix runs
# again. A checkpoint costs memory only (the states are kept, not copied), and a prefill cut at
# every boundary runs in shorter pieces (docs/benchmarks.md measures both).
CHECKPOINT_INTERVAL = 512
# Checkpoints kept per sequence: each holds every linear layer's state (~19 MB at Qwen3.5-0.8B's
# shape in fp32, ~50 MB at 9B's), so they are few, as llama.cpp's state checkpoints are.
MAX_CHECKPOINTS = 8

Point = dict[int, DeltaNetState]  # linear layer → its state after a point's tokens


@dataclass
class SavedRecurrent(SavedCache):
    """A host copy of a recurrent cache: the keys and values, the states and the checkpoints."""

    states: dict[int, tuple[DeltaNetState, int]] = field(default_factory=dict)
    points: dict[int, Point] = field(default_factory=dict)

    def nbytes(self) -> int:
        return super().nbytes() + _state_bytes(self.states, self.points)

    def resumable(self, length: int) -> int:
        return _resumable(length, self.length, self.states, len(self.states), self.points, {})


class RecurrentCache(KVCache):
    """Keys and values of the layers that keep them (`kv_layers`), a state per linear layer,
    and checkpoints of those states. `state_bytes`: the linear layers' states of one sequence."""

    def __init__(self, *args: Any, state_bytes: int, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.state_bytes = state_bytes
        self.interval = CHECKPOINT_INTERVAL  # an attribute: a test sets a shorter one
        self.linear_layers = [layer for layer, kept in enumerate(self.kv_layers) if not kept]
        self.states: dict[int, tuple[DeltaNetState, int]] = {}  # layer → (state, tokens seen)
        self.points: dict[int, Point] = {}  # length → every linear layer's state there
        self.rows: dict[int, dict[int, DeltaNetState]] = {}  # the last check's: layer → length → state

    # What a linear layer reads and writes -------------------------------------------------

    def state_before(self, layer: int, position: int) -> DeltaNetState | None:
        """The layer's state after the first `position` tokens; None: a fresh sequence's."""
        if position == 0:
            return None
        state, seen = self.states[layer]
        if seen != position:  # never read a state of another length than the pass's start
            raise RuntimeError(f"layer {layer}'s state has seen {seen} tokens, not {position}")
        return state

    def hold_state(self, layer: int, state: DeltaNetState, seen: int) -> None:
        self.states[layer] = (state, seen)
        self.rows.pop(layer, None)

    def hold_rows(self, layer: int, states: list[DeltaNetState], start: int) -> None:
        """A check's states, row by row from `start`: the last is the layer's state, each of the
        others where a crop to the tokens accepted lands."""
        self.states[layer] = (states[-1], start + len(states))
        self.rows[layer] = {start + row + 1: state for row, state in enumerate(states)}

    # Checkpoints ------------------------------------------------------------------------

    def checkpoint(self) -> None:
        """Keep the states as they are now as a checkpoint at the length held (where every
        linear layer's state has seen exactly that length), thinning the oldest close ones."""
        length = self.length
        if length == 0 or length in self.points or not self._states_at(length):
            return
        self.points[length] = {layer: state for layer, (state, _) in self.states.items()}
        while len(self.points) > MAX_CHECKPOINTS:
            positions = sorted(self.points)
            # The newest is never dropped: it is where the next prompt most likely resumes.
            pairs = zip([0, *positions[:-2]], positions[:-1], strict=True)
            gaps = [(position - before, position) for before, position in pairs]
            del self.points[min(gaps)[1]]

    def resumable(self, length: int) -> int:
        """The longest prefix, at most `length` tokens, a crop keeps: `length` where the states
        have seen exactly that, else the last checkpoint (or check row) at or before it."""
        rows = self._common_rows()
        return _resumable(length, self.length, self.states, len(self.linear_layers), self.points, rows)

    def crop(self, length: int) -> None:
        keep = self.resumable(length)
        if keep > 0 and not self._states_at(keep):
            self.states = {layer: (state, keep) for layer, state in self._point_at(keep).items()}
        super().crop(keep)
        self.rows.clear()
        if self.length == 0:
            self.states.clear()
            self.points.clear()
        self.points = {position: point for position, point in self.points.items() if position <= self.length}

    def _states_at(self, length: int) -> bool:
        return _states_at(self.states, length, len(self.linear_layers))

    def _point_at(self, length: int) -> Point:
        """Every linear layer's state after `length` tokens (a length `resumable` gave): the
        states held, the last check's row there, or the checkpoint there."""
        if self._states_at(length):
            return {layer: state for layer, (state, _) in self.states.items()}
        return self._common_rows().get(length) or self.points[length]

    def _common_rows(self) -> dict[int, Point]:
        """The last check's per-row states held by every linear layer, by length."""
        if len(self.rows) < len(self.linear_layers):
            return {}
        lengths = set.intersection(*(set(rows) for rows in self.rows.values()))
        return {length: {layer: rows[length] for layer, rows in self.rows.items()} for length in lengths}

    # Copies -----------------------------------------------------------------------------

    def save(self) -> SavedRecurrent:
        kv = super().save()
        states = {layer: (_to(state, "cpu"), seen) for layer, (state, seen) in self.states.items()}
        points = {length: _point_to(point, "cpu") for length, point in self.points.items()}
        return SavedRecurrent(kv.length, kv.written, kv.keys, kv.values, kv.shifts, states, points)

    def restore(self, saved: SavedCache) -> None:
        assert isinstance(saved, SavedRecurrent)
        super().restore(saved)
        states = saved.states.items()
        self.states = {layer: (_to(state, self.device), seen) for layer, (state, seen) in states}
        self.points = {length: _point_to(point, self.device) for length, point in saved.points.items()}
        self.rows.clear()

    def copy_prefix(self, source: KVCache, length: int) -> int:
        """The keys and values of `source`'s first positions and its states there: up to the
        last point at or before `length` it can resume at (0: nothing copied)."""
        assert isinstance(source, RecurrentCache)
        keep = source.resumable(min(length, source.length))
        if keep == 0:
            return 0
        point = source._point_at(keep)
        points = {position: kept for position, kept in source.points.items() if position <= keep}
        if super().copy_prefix(source, keep) == 0:  # emptied this cache first (crop(0))
            return 0
        self.states = {layer: (state, keep) for layer, state in point.items()}
        self.points = points
        return keep

    # Memory -----------------------------------------------------------------------------

    def bytes_for(self, positions: int) -> int:
        """The keys and values, the states and as many checkpoints as may be kept."""
        return super().bytes_for(positions) + (1 + MAX_CHECKPOINTS) * self.state_bytes

    def bytes_beside_pool(self) -> int:
        """Its rings, and the states with as many checkpoints as may be kept."""
        return super().bytes_beside_pool() + (1 + MAX_CHECKPOINTS) * self.state_bytes

    def nbytes(self) -> int:
        return super().nbytes() + _state_bytes(self.states, self.points)


def _states_at(states: dict[int, tuple[DeltaNetState, int]], length: int, layers: int) -> bool:
    """Whether every linear layer holds a state that has seen exactly `length` tokens."""
    held = list(states.values())  # a copy: a server's compute thread may write meanwhile
    return len(held) == layers and all(seen == length for _, seen in held)


def _resumable(
    length: int,
    held: int,
    states: dict[int, tuple[DeltaNetState, int]],
    layers: int,
    points: dict[int, Point],
    rows: dict[int, Point],
) -> int:
    """`length` (at most `held`) where the `layers` linear layers' states have seen exactly
    that, else the last checkpoint or check row at or before it; 0 where there is none."""
    length = min(length, held)
    if length == 0:
        return 0
    if length == held and layers and _states_at(states, held, layers):
        return length
    return max((position for position in [*list(points), *rows] if position <= length), default=0)


def _state_bytes(states: dict[int, tuple[DeltaNetState, int]], points: dict[int, Point]) -> int:
    """Bytes of the states and checkpoints, each tensor once (a checkpoint may be the state)."""
    tensors = {id(state): state for state, _ in states.values()}
    tensors.update((id(state), state) for point in points.values() for state in point.values())
    return bytes_of([tensor for state in tensors.values() for tensor in (state.conv, state.recurrent)])


def _to(state: DeltaNetState, device: torch.device | str) -> DeltaNetState:
    """The state on `device`: itself where it is there already (states are never written into)."""
    return DeltaNetState(state.conv.to(device), state.recurrent.to(device))


def _point_to(point: Point, device: torch.device | str) -> Point:
    return {layer: _to(state, device) for layer, state in point.items()}
