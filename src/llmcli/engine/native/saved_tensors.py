"""A native cache's host copy (kvcache.SavedCache, recurrent_cache.SavedRecurrent) as named
tensors and a small description, and back: what the prompt cache on disk writes and reads
(engine/disk_prefix.py).

Read back, every tensor is checked against what this backend's cache holds (names, shapes,
dtypes): a file from another shape of model, or edited, is refused (ValueError) before anything
is restored from it. A checkpoint of a recurrent state is often the state itself (the same
tensor): it is written once and read back as one.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from llmcli.engine.native.gated_deltanet import DeltaNetState
from llmcli.engine.native.kvcache import SavedCache
from llmcli.engine.native.recurrent_cache import RecurrentCache, SavedRecurrent

if TYPE_CHECKING:
    from llmcli.engine.disk_prefix import DiskTier
    from llmcli.engine.native.backend import NativeBackend


def to_tensors(saved: SavedCache) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The copy's tensors by name (contiguous, each once), and what says how they fit together."""
    tensors: dict[str, torch.Tensor] = {}
    for layer, (keys, values) in enumerate(zip(saved.keys, saved.values, strict=True)):
        tensors[f"k.{layer}"] = keys.contiguous()
        tensors[f"v.{layer}"] = values.contiguous()
    layout: dict[str, Any] = {
        "length": saved.length,
        "written": saved.written,
        "shifts": [list(shift) for shift in saved.shifts],
    }
    if isinstance(saved, SavedRecurrent):
        names: dict[int, str] = {}  # id() of a tensor → its name: a checkpoint shares the state's

        def name_of(state: DeltaNetState) -> list[str]:
            pair = []
            for tensor in (state.conv, state.recurrent):
                if id(tensor) not in names:
                    names[id(tensor)] = f"s.{len(names)}"
                    tensors[names[id(tensor)]] = tensor.contiguous()
                pair.append(names[id(tensor)])
            return pair

        layout["states"] = {
            str(layer): [*name_of(state), seen] for layer, (state, seen) in saved.states.items()
        }
        layout["points"] = {
            str(length): {str(layer): name_of(state) for layer, state in point.items()}
            for length, point in saved.points.items()
        }
    return tensors, layout


def resume_points(saved: SavedCache) -> list[int] | None:
    """Where a cache restored from this copy can be cropped to: None for any length (keys and
    values alone), else the recurrent state's checkpoints and its end where it is one."""
    if not isinstance(saved, SavedRecurrent):
        return None
    points = set(saved.points)
    if saved.resumable(saved.length) == saved.length:
        points.add(saved.length)
    return sorted(points)


def from_tensors(
    tensors: dict[str, torch.Tensor], layout: dict[str, Any], backend: NativeBackend
) -> SavedCache:
    """The host copy these tensors are, checked against `backend`'s cache: ValueError naming
    the first tensor that is not what that cache holds."""
    cache = backend.cache
    length, written = int(layout["length"]), int(layout["written"])
    if not 0 < length <= written <= cache.context_length:
        raise ValueError(f"a length of {length} ({written} written) does not fit this cache")
    keys, values = [], []
    for layer, ring in enumerate(cache.rings):
        heads, width = cache.shapes[layer]
        positions = 0 if not cache.kv_layers[layer] else ring if ring is not None else length
        expected = (heads, positions, width)
        keys.append(_checked(tensors, f"k.{layer}", expected, cache.dtype))
        values.append(_checked(tensors, f"v.{layer}", expected, cache.dtype))
    shifts = tuple((int(index), int(shift)) for index, shift in layout["shifts"])
    kv_names = {f"{kind}.{layer}" for kind in "kv" for layer in range(len(cache.rings))}
    if not isinstance(cache, RecurrentCache):
        _no_others(tensors, kv_names)
        return SavedCache(length, written, keys, values, shifts)
    shapes = {layer: backend.net.blocks[layer].mixer.shape for layer in cache.linear_layers}

    def state_of(layer: int, pair: list[str]) -> DeltaNetState:
        if layer not in shapes:
            raise ValueError(f"layer {layer} keeps no recurrent state")
        empty = DeltaNetState.empty(shapes[layer], cache.dtype, "meta")
        conv = _checked(tensors, pair[0], tuple(empty.conv.shape), empty.conv.dtype)
        recurrent = _checked(tensors, pair[1], tuple(empty.recurrent.shape), empty.recurrent.dtype)
        return DeltaNetState(conv, recurrent)

    states = {
        int(layer): (state_of(int(layer), entry[:2]), int(entry[2]))
        for layer, entry in layout["states"].items()
    }
    if sorted(states) != sorted(shapes) or any(not 0 < seen <= length for _, seen in states.values()):
        raise ValueError("the recurrent states are not this cache's")
    points = {
        int(at): {int(layer): state_of(int(layer), pair) for layer, pair in point.items()}
        for at, point in layout["points"].items()
    }
    if any(not 0 < at <= length or sorted(point) != sorted(shapes) for at, point in points.items()):
        raise ValueError("a checkpoint is not this cache's")
    named = [*(entry[:2] for entry in layout["states"].values())]
    named += [pair for point in layout["points"].values() for pair in point.values()]
    _no_others(tensors, kv_names | {name for pair in named for name in pair})
    return SavedRecurrent(length, written, keys, values, shifts, states, points)


def _checked(
    tensors: dict[str, torch.Tensor], name: str, shape: tuple[int, ...], dtype: torch.dtype
) -> torch.Tensor:
    tensor = tensors.get(name)
    if tensor is None:
        raise ValueError(f"tensor {name} is missing")
    if tuple(tensor.shape) != shape or tensor.dtype != dtype:
        raise ValueError(
            f"tensor {name} is {tuple(tensor.shape)} {tensor.dtype}, this cache's {shape} {dtype}"
        )
    return tensor


def _no_others(tensors: dict[str, torch.Tensor], names: set[str]) -> None:
    extra = sorted(set(tensors) - names)
    if extra:
        raise ValueError(f"tensor {extra[0]} is not this cache's")


def disk_tier_for(
    backend: Any, facts: dict[str, Any], budget_bytes: int, folder: Path, warn: Callable[[str], None]
) -> DiskTier | None:
    """The disk tier of a native backend's cache (None for another backend: transformers'
    caches are not copied), keyed by `facts` (the model's fingerprint and load settings) and
    what this cache's numbers and shapes depend on."""
    from llmcli.engine.disk_prefix import DiskTier
    from llmcli.engine.native.backend import NativeBackend

    native = getattr(backend, "inner", backend)  # a server's slot takes turns (scheduler.py)
    if not isinstance(native, NativeBackend):
        return None
    device = native.device
    key = {
        **facts,
        "engine": native.name,
        "device": device.type,
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "kv_dtype": str(native.cache.dtype),
        "fixed_shapes": native.static_shapes,
        "context_length": native.cache.context_length,
    }

    def flatten(saved: Any) -> tuple[dict[str, Any], dict[str, Any], list[int] | None]:
        tensors, layout = to_tensors(saved)
        return tensors, layout, resume_points(saved)

    return DiskTier(
        folder,
        key,
        budget_bytes,
        lambda tensors, layout: from_tensors(tensors, layout, native),
        flatten,
        warn,
    )
