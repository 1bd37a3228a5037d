"""What every kind of the prefix store's entries is measured and brought with (prefix.py, and
its disk tier, disk_prefix.py, which it imports): how long a prefix two texts share, and what an
entry asks of the engine it is brought into. Torch-free."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from llmcli.engine.backend import Backend


def common_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class Engine(Protocol):
    """What the store asks of an engine (held.HeldCache): its backend and the exact ids its
    cache holds, and a crop that keeps the two equal."""

    backend: Backend
    cached_ids: list[int]

    def crop_to(self, keep: int) -> None: ...
