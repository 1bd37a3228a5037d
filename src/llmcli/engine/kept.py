"""Conversations set aside: what a server's one KV cache held before a request from another
conversation took it, copied to host memory, and copied back when that conversation returns.

A server runs one generation at a time over one cache. Without this, three chats whose turns
interleave each find the cache holding another's text and prefill their whole history again.
The engine (loop.py) asks here before it crops the cache for a new prompt: the text it would
lose is set aside when it is long enough to be worth a copy, and a set-aside text sharing a
longer prefix with the prompt than the cache does comes back. The copies are bounded in bytes
and the least recently used go first.

Copies of whole sequences, not blocks shared by content: two conversations with one long
system prompt each keep their own copy of it. A paged cache (issue 28) would share them.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

# Fewer tokens than this about to be lost are not set aside: a copy is not worth a short
# prefill, and the same conversation cropping its last reply (a retry) would fill the store.
MIN_SET_ASIDE_TOKENS = 64
# A set-aside text comes back only when it saves at least this many tokens of prefill.
MIN_RESTORED_GAIN = 16

_clock = itertools.count()


def common_prefix_length(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


@dataclass
class SetAside:
    ids: list[int]  # exactly the tokens whose keys and values `saved` holds
    saved: Any  # the backend's copy (Backend.save)
    used: int = field(default_factory=lambda: next(_clock))

    def __post_init__(self) -> None:
        self.nbytes: int = self.saved.nbytes()  # once: the budget sums them at every add


class KeptConversations:
    def __init__(self, budget_bytes: int) -> None:
        self.budget_bytes = budget_bytes
        self.entries: list[SetAside] = []
        self.restored = 0  # conversations brought back (the tests read it)

    @property
    def nbytes(self) -> int:
        return sum(entry.nbytes for entry in self.entries)

    def best_for(self, ids: list[int]) -> tuple[int, SetAside | None]:
        """The set-aside text sharing the longest prefix with `ids`, and that length."""
        best, best_length = None, 0
        for entry in self.entries:
            length = common_prefix_length(entry.ids, ids)
            if length > best_length:
                best, best_length = entry, length
        return best_length, best

    def add(self, ids: list[int], saved: Any) -> None:
        """Keep a copy, dropping the ones it makes useless (texts it starts with), then the
        least recently used until the store fits its budget. A copy larger than the whole
        budget is not kept."""
        entry = SetAside(list(ids), saved)
        if entry.nbytes > self.budget_bytes:
            return
        self.entries = [kept for kept in self.entries if kept.ids != ids[: len(kept.ids)]]
        self.entries.append(entry)
        self.entries.sort(key=lambda entry: entry.used)
        while self.nbytes > self.budget_bytes:
            self.entries.pop(0)

    def take(self, entry: SetAside) -> SetAside:
        """Remove an entry to bring it back into the cache (it is the cache's text again)."""
        self.entries.remove(entry)
        self.restored += 1
        return entry
