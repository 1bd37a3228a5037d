"""Which cached state a prompt starts from, and how long a prefix of it: one store per set of
weights, which also owns what is kept aside in host memory and when it goes.

The states a prompt may start from (entries):
- `Own`: the engine's own cache, cropped to what it shares with the prompt;
- `Running`: another slot's live cache over the same weights (a server's requests with one
  system prompt, a request's n choices), its prefix copied rather than prefilled again;
- `HostCopy`: a cache set aside in host memory when a prompt from another conversation was about
  to crop it, brought back when that conversation returns (three chats whose turns interleave
  would otherwise each find the cache holding another's text and prefill their whole history).

- `DiskCopy` (disk_prefix.py): a state written to a file under the cache folder by this
  process or an earlier one (a one-shot `generate` over the same document, a restarted server's
  conversation), read and checked when brought.

One rule picks among them (`PrefixStore.best`): the engine's own cache, unless another slot's
shares at least MIN_RESTORED_GAIN more, unless a host copy shares that much more again, unless a
file on disk shares MIN_DISK_TOKENS more than that (reading one costs its whole size). A
server's slots share one store (a conversation set aside by one may come back in any); a
one-conversation process (generate, chat, a draft model) has a store with no budget, which keeps
nothing and so only ever crops.

Host copies are of whole sequences, not blocks shared by content: two conversations with one
long system prompt each keep their own copy of it. A paged cache (issue 28) would share them.

Torch-free: engines are only named in type hints, by the little the store asks of them (`Engine`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from llmcli.engine.disk_prefix import MIN_DISK_TOKENS, DiskCopy, Refused
from llmcli.engine.prefix_base import Engine, common_prefix_length

if TYPE_CHECKING:
    from llmcli.engine.backend import Saved
    from llmcli.engine.disk_prefix import DiskTier

__all__ = ["Engine", "PrefixStore", "common_prefix_length"]

# Fewer tokens than this about to be lost are not set aside: a copy is not worth a short
# prefill, and the same conversation cropping its last reply (a retry) would fill the store.
MIN_SET_ASIDE_TOKENS = 64
# Another state replaces the one at hand only when it saves at least this many tokens of prefill.
MIN_RESTORED_GAIN = 16


class Entry(Protocol):
    """A cached state a prompt may start from: the tokens it stands for, how far into them it
    can be resumed, and how to make an engine hold that prefix.

    A kind of state is one class with these two methods; the store's rule and its eviction need
    nothing else (a kind kept in host memory, in `PrefixStore.entries`, also says its `nbytes`,
    which the budget counts). Keys and values can be cropped anywhere, so their `reach` is the
    length asked. A recurrent layer's state folds every token in and cannot be cropped: a cache
    holding one keeps checkpoints of it (native/recurrent_cache.py), and its `reach` is the
    last one at or below the length asked, as the backend (or the host copy) says
    (`resumable`); `bring` crops there the same way.
    """

    @property
    def ids(self) -> Sequence[int]:
        """Exactly the tokens this state holds."""
        ...

    def reach(self, length: int) -> int:
        """The longest prefix, at most `length` tokens of `ids`, this state can be resumed at."""
        ...

    def bring(self, into: Engine, length: int) -> int:
        """Make `into` hold `ids[:length]` (`length` a reach of this entry); the tokens it holds
        then (fewer where its backend could not keep them: a wrapped sliding ring holds none)."""
        ...


@dataclass(eq=False)
class EngineCache:
    """An engine's cache as it is: the tokens it holds, resumable where its backend says (any
    length for keys and values, a checkpoint for a recurrent state)."""

    engine: Engine

    @property
    def ids(self) -> Sequence[int]:
        return self.engine.cached_ids

    def reach(self, length: int) -> int:
        return self.engine.backend.resumable(length)


class Own(EngineCache):
    """The engine's own cache: cropped to the prefix (nothing copied)."""

    def bring(self, into: Engine, length: int) -> int:
        into.crop_to(length)
        return len(into.cached_ids)


class Running(EngineCache):
    """Another slot's live cache over the same weights: its prefix copied into the engine, a
    memory copy rather than a prefill (scheduler.TakingTurns.copy_prefix)."""

    def bring(self, into: Engine, length: int) -> int:
        copied = list(self.engine.cached_ids[:length])  # now: the copy gives the turn up
        held = into.backend.copy_prefix(self.engine.backend, length)  # type: ignore[attr-defined]
        into.cached_ids = copied[:held]
        return held


class HostCopy:
    """A cache set aside in host memory (Backend.save), restored whole and then cropped."""

    def __init__(self, ids: Sequence[int], saved: Saved) -> None:
        self.ids: list[int] = list(ids)  # exactly the tokens whose keys and values `saved` holds
        self.saved = saved
        self.nbytes: int = saved.nbytes()  # once: the budget sums them at every set-aside

    def reach(self, length: int) -> int:
        return self.saved.resumable(length)

    def bring(self, into: Engine, length: int) -> int:
        into.backend.restore(self.saved)
        into.cached_ids = list(self.ids)
        into.crop_to(length)
        return len(into.cached_ids)


@dataclass(frozen=True)
class Match:
    """The entry a prompt starts from, and how long a prefix of it it brings."""

    entry: Entry
    length: int  # the tokens `bring` is asked for (at most the caller's `at_most`)
    shared: int  # what it saves, as the rule compares it


class PrefixStore:
    """Every cached state over one set of weights: the caches of the engines attached (a
    server's slots) and the copies set aside in host memory, within `budget_bytes` (0: none
    kept). Owns eviction: a copy drops those it makes useless (texts it starts with), then the
    least recently set aside go until the copies fit; a copy larger than the whole budget is not
    kept."""

    def __init__(self, budget_bytes: int = 0, disk: DiskTier | None = None) -> None:
        self.budget_bytes = budget_bytes
        self.disk = disk  # the files under the cache folder (disk_prefix.py); None: none
        # Where the last `start`'s tokens came from, as --json's `cached_from` says it: "memory"
        # (the engine's own cache or a host copy), "slot" (another slot's), "disk".
        self.source: str | None = None
        self.entries: list[HostCopy] = []  # least recently set aside first
        self.restored = 0  # host copies brought back (the tests read it)
        self._engines: list[Engine] = []  # a server's slots, in slot order
        self._running: set[int] = set()  # id() of the attached engines a generation runs on

    @property
    def nbytes(self) -> int:
        return sum(entry.nbytes for entry in self.entries)

    def attach(self, engine: Engine) -> None:
        """A slot's engine: its cache, while a generation runs on it, is one the others may
        copy a prefix from."""
        self._engines.append(engine)

    def running(self, engine: Engine, busy: bool) -> None:
        """A generation starts (`busy`) or ends on an attached engine."""
        if busy:
            self._running.add(id(engine))
        else:
            self._running.discard(id(engine))

    def slot_for(self, free: list[Engine], ids: Sequence[int]) -> Engine:
        """The free engine whose own cache shares the most with `ids`: the lowest slot among
        equals, so a pool of slots stays small."""
        return max(
            free,
            key=lambda engine: (
                Own(engine).reach(common_prefix_length(engine.cached_ids, ids)),
                -self._slot(engine),
            ),
        )

    def _slot(self, engine: Engine) -> int:
        return self._engines.index(engine)

    def best(
        self, into: Engine, ids: Sequence[int], at_most: int, others: bool = True, disk: bool = True
    ) -> Match:
        """The state `into` should start `ids` from, bringing at most `at_most` tokens: its own
        cache, unless (`others`) a running slot's shares at least MIN_RESTORED_GAIN more, unless
        a host copy shares that much more again, unless (`disk`) a file shares MIN_DISK_TOKENS
        more. Own cache and host copies are measured by all they share (a copy is restored
        whole); another slot by what it would copy; a file by where it can be resumed."""
        own = Own(into)
        shared = own.reach(common_prefix_length(into.cached_ids, ids))
        best = Match(own, min(shared, at_most), shared)
        if others:
            source = self._running_source(into, ids)
            if source is not None:
                length = source.reach(min(common_prefix_length(source.ids, ids), at_most))
                if length >= best.shared + MIN_RESTORED_GAIN:
                    best = Match(source, length, length)
        copy, shared = self._longest_copy(ids)
        if copy is not None and shared >= best.shared + MIN_RESTORED_GAIN:
            best = Match(copy, min(shared, at_most), shared)
        if disk and self.disk is not None:
            kept, shared = self.disk.longest(ids)
            length = kept.reach(min(shared, at_most)) if kept is not None else 0
            if kept is not None and length >= best.shared + MIN_DISK_TOKENS:
                best = Match(kept, length, length)
        return best

    def _running_source(self, into: Engine, ids: Sequence[int]) -> Running | None:
        """The running slot (other than `into`) sharing the most with `ids`: the first of equals."""
        running = [engine for engine in self._engines if id(engine) in self._running and engine is not into]
        if not running:
            return None
        return Running(max(running, key=lambda engine: common_prefix_length(engine.cached_ids, ids)))

    def _longest_copy(self, ids: Sequence[int]) -> tuple[HostCopy | None, int]:
        """The host copy sharing the longest prefix with `ids` (the least recent of equals), and
        how long a prefix it can be resumed at."""
        best, best_length = None, 0
        for entry in self.entries:
            length = entry.reach(common_prefix_length(entry.ids, ids))
            if length > best_length:
                best, best_length = entry, length
        return best, best_length

    def start(self, into: Engine, ids: Sequence[int], at_most: int) -> int:
        """Make `into` hold the longest prefix of `ids` (at most `at_most` tokens) the best state
        gives, setting aside what it would lose where that is worth a copy; the tokens held."""
        match = self.best(into, ids, at_most)
        copied = isinstance(match.entry, Running)
        if copied:
            match = self._copy_running(into, match.entry, ids, at_most)  # type: ignore[arg-type]
        self._take_out(match)
        self._set_aside(into, ids)
        # What the engine holds now came from another slot where the copy is what it starts from.
        self.source = "slot" if copied and isinstance(match.entry, Own) else "memory"
        if isinstance(match.entry, DiskCopy):
            try:
                held = match.entry.bring(into, match.length)
            except Refused:  # said and removed: the best state without the disk, as if it were not there
                match = self.best(into, ids, at_most, others=False, disk=False)
                self._take_out(match)
            else:
                self.source = "disk"
                return held
        return match.entry.bring(into, match.length)

    def _take_out(self, match: Match) -> None:
        """A host copy about to be restored leaves the store first: setting aside evicts."""
        if match.entry in self.entries:
            self.entries.remove(match.entry)  # type: ignore[arg-type]
            self.restored += 1

    def ended(self, engine: Engine) -> None:
        """A generation ended on `engine`: what its cache holds is kept on disk, where there is
        a disk tier and it is worth a file (disk_prefix.py: copied now, written in the background)."""
        if self.disk is not None:
            self.disk.offer(list(engine.cached_ids), engine.backend.save)

    def _copy_running(self, into: Engine, source: Running, ids: Sequence[int], at_most: int) -> Match:
        """A copy empties `into` first, so what it held is set aside whole (start_over). Setting
        aside waits for a pass, the turn given up meanwhile: the source may have been cropped
        for another request since. So it is measured again, holding the turn (what is written
        below that length from now on waits behind the copy), and what the copy gave is then
        weighed against the host copies as any own cache is."""
        self.start_over(into)
        length = source.reach(min(common_prefix_length(source.ids, ids), at_most))
        if length >= MIN_RESTORED_GAIN:
            source.bring(into, length)
        return self.best(into, ids, at_most, others=False)

    def start_over(self, into: Engine) -> None:
        """Empty `into` for a prompt that must run whole (a seeded draw, a prompt scored), its
        text set aside first where it is worth a copy."""
        self._set_aside(into, [])
        into.crop_to(0)

    def _set_aside(self, into: Engine, ids: Sequence[int]) -> None:
        """Copy what `into` holds aside when `ids` would crop enough of it to be worth it."""
        if self.budget_bytes <= 0:
            return  # nothing would be kept: no copy made
        held = into.cached_ids
        if len(held) - common_prefix_length(held, ids) < MIN_SET_ASIDE_TOKENS:
            return
        saved = into.backend.save()
        if saved is not None:  # transformers' caches are not copied (hf.py)
            self._keep(HostCopy(held, saved))
            if self.disk is not None:  # a server's conversation set aside outlives a restart too
                self.disk.offer(list(held), lambda: saved)

    def _keep(self, copy: HostCopy) -> None:
        if copy.nbytes > self.budget_bytes:
            return
        self.entries = [kept for kept in self.entries if kept.ids != copy.ids[: len(kept.ids)]]
        self.entries.append(copy)
        while self.nbytes > self.budget_bytes:
            self.entries.pop(0)
