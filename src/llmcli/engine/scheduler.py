"""Several generations at once over one model: continuous batching for a server.

Each generation runs the ordinary loop (loop.py: sampling, stop strings, grammars, reasoning,
tool calls) in a thread of its own, and the generations take turns: one at a time holds `turn`,
so a tokenizer, a grammar and the loop's Python objects are never used by two threads at once.
Every forward pass runs on one compute thread (`ComputeThread`), the one that loaded the model:
torch's parallel ops on a second thread start a second OpenMP team, whose workers sleep between
regions (2× slower decoding measured on 2 cores, frontends/serve.py). When every generation in
progress waits for a pass, the compute thread runs the waiting prefills one by one, then one
decode step for all the waiting tokens together (native/batched.py: the weights read once for
every row; on a GPU one CUDA graph per batch bucket and length bucket), and hands each its
logits; one waiting alone takes its own step (its own graph). A generation joins at the next
step and leaves when it ends; one whose step ran out of memory beside others is preempted
(ComputeThread._decode). Over a paged KV pool (native/paged_slots.py) the newest sequence is
preempted when a step or a prefill finds no free block: its keys and values set aside in host
memory, its blocks let go, its pass parked until there is room again (ComputeThread._park).

Each generation has an engine of its own (`Slots`): its own cache over the shared weights, so a
row's logits are what it would get alone (tests/test_native.py holds them within 1e-5). The
slots share one prefix store (prefix.py), which answers where a prompt starts from: a request
takes the free slot whose cache shares the most with its prompt; as its generation starts, what
it crops is set aside in host memory, a conversation set aside comes back into it, or, where a
running generation's cache shares more (requests with one system prompt, a request's n
choices), that prefix is copied from it, a memory copy rather than a prefill. Over a paged pool
(`Slots(paged=True)`, a GPU's default) such a prefix is held once, its blocks shared by content,
and kept after its generation ends (on a CPU the attention over gathered blocks cost more than
it saves: docs/benchmarks.md).
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Executor, Future
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from llmcli.engine.image_markers import chunk_ends
from llmcli.engine.loop import Engine
from llmcli.engine.native.backend import GRAPHED_ROWS, NativeBackend
from llmcli.engine.native.batched import BatchedDecode
from llmcli.engine.native.paged_backend import PagedBackend
from llmcli.engine.native.paged_slots import PagedSlots
from llmcli.engine.native.pool import SlotPool
from llmcli.errors import KVMemoryFull

T = TypeVar("T")

# A prompt is prefilled this many tokens at a time, decode steps of the others between the
# slices (the demo on 2 cores: ~0.25 s a slice).
PREFILL_SLICE = 256
SHUTDOWN_WAIT_S = 10.0
# How long a step waits for a generation that holds its turn but has not asked for a pass yet
# (a grammar compiling, a long detokenization): past it, the step runs without that one.
STRAGGLER_WAIT_S = 0.02


@dataclass
class _Pass:
    """A forward pass a generation waits for: a decode step's token, or any other call."""

    backend: NativeBackend | None = None  # a decode step of this backend's sequence
    token: torch.Tensor | None = None
    call: Callable[[], Any] | None = None  # a prefill, a check, a warm-up: run alone
    owner: NativeBackend | None = None  # the sequence a call writes (a prefill, a check)
    done: threading.Event = field(default_factory=threading.Event)
    result: Any = None
    error: BaseException | None = None


class ComputeThread(Executor):
    """The one thread that runs forward passes: an executor for any call (a load, a tokenizer
    call: run holding `turn`), and the batcher of the generations' passes."""

    def __init__(self, name: str = "llmcli-compute") -> None:
        # Held by the generation (or call) whose Python code runs. Reentrant: with one generation
        # at a time, generations run as calls on this thread itself (Slots, count 1).
        self.turn = threading.RLock()
        self.active = 0  # generations in progress (each holds a slot), changed under `turn`
        self._changed = threading.Condition()
        self._calls: list[tuple[Future[Any], Callable[[], Any]]] = []
        self._passes: list[_Pass] = []
        self._first_pass_at = 0.0
        self._stopping = False
        self.on_step: Callable[[int], None] | None = None  # told each decode step's sequence count
        self.on_preempt: Callable[[], None] | None = None  # told each sequence preempted for blocks
        # The decode step of several sequences of Slots' pool (batched.py: fixed shapes, a CUDA
        # graph per shape, where the engine takes them); None: Transformer.decode_sequences.
        self.batched: BatchedDecode | PagedSlots | None = None
        # Out of memory in a step of several sequences (_decode): the newest is preempted.
        self._joined: dict[int, int] = {}  # id(backend) → when its running generation took it
        self._joins = itertools.count()
        self._fits: int | None = None  # sequences a step held when one last fitted after running out
        # Passes of sequences preempted for want of a paged pool's blocks, the first preempted
        # first: run once they have room again (_readmit), tried at each step and as a
        # generation ends (`_room_freed`).
        self._parked: list[_Pass] = []
        self._room_freed = False
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    # The executor, for calls from outside the generations ---------------------------------

    def submit(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> Future[T]:
        future: Future[T] = Future()
        with self._changed:
            if self._stopping:
                raise RuntimeError("the compute thread has stopped")
            self._calls.append((future, lambda: fn(*args, **kwargs)))
            self._changed.notify()
        return future

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        with self._changed:
            self._stopping = True
            if cancel_futures:
                for future, _ in self._calls:
                    future.cancel()
                self._calls.clear()
            self._changed.notify()
        if wait and threading.current_thread() is not self._thread:
            # A step in progress ends within a token; a call (a load) is not waited for long.
            self._thread.join(timeout=SHUTDOWN_WAIT_S)

    # What a generation's backend asks for ----------------------------------------------------

    @contextmanager
    def generation(self) -> Iterator[None]:
        """A generation's turn to run, from its start to its end (given up while it waits)."""
        with self.turn:
            self.active += 1
            try:
                yield
            finally:
                self.active -= 1
                self._fits = None  # fewer sequences now: a full step may fit again
                with self._changed:
                    self._room_freed = True  # its blocks let go: a parked sequence may fit
                    self._changed.notify()  # a step may have been waiting for this one

    def joined(self, backend: NativeBackend) -> None:
        """A generation starts on `backend` (Slots.take): the newest, the first preempted."""
        self._joined[id(backend)] = next(self._joins)

    def run(self, wanted: _Pass) -> Any:
        """Wait for a pass, giving up the turn meanwhile (called holding it)."""
        with self._changed:
            if not self._passes:
                self._first_pass_at = time.monotonic()
            self._passes.append(wanted)
            self._changed.notify()
        self.turn.release()
        try:
            wanted.done.wait()
        finally:
            self.turn.acquire()
        if wanted.error is not None:
            raise wanted.error
        return wanted.result

    # The thread ----------------------------------------------------------------------------

    def _loop(self) -> None:
        with torch.inference_mode():  # as every generation runs; thread-local, so set here
            while True:
                with self._changed:
                    while not (self._stopping or self._calls or self._step_ready() or self._retry()):
                        self._changed.wait(timeout=self._wait_s())
                    if self._stopping and not self._passes:
                        _fail(self._parked, RuntimeError("the server stopped"))
                        return
                    calls, self._calls = self._calls, []
                    passes = self._passes if self._step_ready() else []
                    if passes:
                        self._passes = []
                    retry, self._room_freed = self._retry(), False
                for future, call in calls:
                    if future.set_running_or_notify_cancel():
                        self._run_call(future, call)
                if retry or (passes and self._parked):
                    passes = self._readmit(margin=len(passes)) + passes
                if passes:
                    self._step(passes)

    def _step_ready(self) -> bool:
        """Every generation in progress waits for a pass, or the others were waited for long
        enough."""
        if not self._passes:
            return False
        waiting = len(self._passes) + len(self._parked)
        return waiting >= self.active or time.monotonic() - self._first_pass_at >= STRAGGLER_WAIT_S

    def _retry(self) -> bool:
        """A generation ended while others were parked: their room may be free now."""
        return self._room_freed and bool(self._parked)

    def _wait_s(self) -> float | None:
        return STRAGGLER_WAIT_S if self._passes else None

    def _run_call(self, future: Future[Any], call: Callable[[], Any]) -> None:
        """A call from outside: holding the turn, as it may use the tokenizer."""
        try:
            with self.turn:
                result = call()
        except BaseException as error:  # handed to whoever waits on the future
            future.set_exception(error)
        else:
            future.set_result(result)

    def _step(self, passes: list[_Pass]) -> None:
        decodes = [wanted for wanted in passes if wanted.backend is not None]
        for wanted in passes:
            if wanted.call is not None:
                self._alone(wanted, wanted.call)
        if decodes and self.on_step is not None:
            self.on_step(len(decodes))
        if decodes:
            self._decode(decodes)

    def _decode(self, decodes: list[_Pass]) -> None:
        """One step for these sequences' tokens; one alone takes its own step (a CUDA graph
        where it has one). An out-of-memory error in it (on a GPU: a cache
        growing, a graph captured for a new shape, an eager step's activations) preempts the
        newest sequence: the caches are set back to their lengths before the step, the memory
        the step took is given back, and the step runs again without it; the preempted one is
        requeued behind it, its own step run alone once the others' is done (if that runs out
        too, the error is its alone). Until a generation ends, steps hold at most as many
        sequences as the last that fitted. The others never see the error. The pool is one
        tensor for every slot: a running sequence's keys and values cannot be given back alone
        (a paged pool's blocks could). A model with recurrent states is not stepped again: a
        state a failed step has moved on cannot be set back."""
        order = sorted(decodes, key=lambda wanted: self._joined.get(id(wanted.backend), -1))
        fits = len(order) if self._fits is None else max(1, self._fits)
        together, requeued = order[:fits], order[fits:]
        while len(together) > 1:
            caches = [wanted.backend.cache for wanted in together]  # type: ignore[union-attr]
            lengths = [cache.length for cache in caches]
            try:
                rows = _decode_together(together, self.batched)
            except torch.OutOfMemoryError as error:
                if together[0].backend.net.recurrent:  # type: ignore[union-attr]
                    _fail(together, error)
                    return
                for cache, length in zip(caches, lengths, strict=True):
                    cache.length = length
                _give_back_memory(caches[0].device)
                requeued.insert(0, together.pop())
                self._fits = len(together)
                continue
            except KVMemoryFull as error:  # a paged pool's blocks: room made before any write
                self._park(together.pop(), error)
                continue
            except BaseException as error:
                _fail(together, error)
                together = []
                break
            for index, wanted in enumerate(together):
                wanted.result = rows[index : index + 1].clone()
                wanted.done.set()
            together = []
        for wanted in together + requeued:  # alone: each its own step, as one sequence's is
            backend, token = wanted.backend, wanted.token
            assert backend is not None and token is not None
            self._alone(wanted, lambda backend=backend, token=token: backend.decode(token))

    def _alone(self, wanted: _Pass, call: Callable[[], Any]) -> None:
        """`wanted`'s pass on its own; one that finds no free block in a paged pool parked."""
        try:
            wanted.result = call()
        except KVMemoryFull as error:
            self._park(wanted, error)  # parked, or the error told
            return
        except BaseException as error:
            wanted.error = error
        wanted.done.set()

    def _park(self, wanted: _Pass, error: KVMemoryFull) -> bool:
        """Preempt the sequence of a pass that found no free block of a paged pool (its keys and
        values copied to host memory, its blocks let go) and park the pass until there is room:
        True. Where no other sequence holds a block to wait for (the sequence alone does not fit
        the pool), or the pool is not paged, the error is the pass's, told to it: False."""
        backend = wanted.owner or wanted.backend
        if not isinstance(backend, PagedBackend) or not _others_hold_blocks(backend):
            wanted.error = error
            wanted.done.set()
            return False
        backend.preempt()
        self._parked.append(wanted)
        if self.on_preempt is not None:
            self.on_preempt()
        return True

    def _readmit(self, margin: int) -> list[_Pass]:
        """The parked passes whose sequences fit the pool again, held again (the first preempted
        first, none past one that does not fit). Beside running sequences, one is tried only
        where `margin` more blocks (one per running sequence's next step) stay free after it, so
        a sequence brought back is not preempted again at once."""
        back: list[_Pass] = []
        while self._parked:
            wanted = self._parked[0]
            backend = wanted.owner or wanted.backend
            assert isinstance(backend, PagedBackend) and backend.preempted is not None
            others = _others_hold_blocks(backend)
            blocks = backend.store.blocks
            need = -(-(backend.preempted.length + 1) // blocks.block_size)
            if others and blocks.available() < need + margin:
                break
            try:
                backend.readmit()
            except KVMemoryFull as error:
                if others:
                    break
                self._parked.pop(0)  # nothing left to wait for: it does not fit alone
                _fail([wanted], error)
                continue
            back.append(self._parked.pop(0))
        return back


def _others_hold_blocks(backend: PagedBackend) -> bool:
    """Whether sequences besides `backend`'s hold blocks of its pool (kept ones held by none)."""
    blocks = backend.store.blocks
    return blocks.num_blocks - blocks.available() > backend.holds_blocks_alone()


def _fail(passes: list[_Pass], error: BaseException) -> None:
    for wanted in passes:
        wanted.error = error
        wanted.done.set()


def _give_back_memory(device: torch.device) -> None:
    """The memory a failed step took, back to the device (the allocator keeps it cached)."""
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _settle(wanted: _Pass, call: Callable[[], Any]) -> None:
    try:
        wanted.result = call()
    except BaseException as error:
        wanted.error = error
    wanted.done.set()


def _decode_together(decodes: list[_Pass], batched: BatchedDecode | PagedSlots | None) -> torch.Tensor:
    backends = [wanted.backend for wanted in decodes]
    assert all(backend is not None for backend in backends)
    caches = [backend.cache for backend in backends]  # type: ignore[union-attr]
    tokens = torch.cat([wanted.token.view(1) for wanted in decodes])  # type: ignore[union-attr]
    if batched is not None:
        return batched.step(tokens, caches)
    return backends[0].net.decode_sequences(tokens, caches)  # type: ignore[union-attr]


class TakingTurns:
    """A backend whose forward passes run on the compute thread (the Backend protocol of
    backend.py): the cache's bookkeeping stays with the generation."""

    def __init__(self, inner: Any, compute: ComputeThread) -> None:
        self.inner, self.compute = inner, compute
        self.name = inner.name
        self.device = inner.device
        # Only the native engine's steps join others; any other backend's run alone.
        self._joins = isinstance(inner, NativeBackend)

    @property
    def length(self) -> int:
        return self.inner.length

    @property
    def captures_graphs(self) -> bool:
        return self.inner.captures_graphs

    def prefill(self, ids: list[int]) -> torch.Tensor:
        """In slices, each its own pass: the other generations' decode steps run between them,
        so a long prompt slows the running streams rather than stopping them."""
        logits = None
        start = 0
        for end in chunk_ends(ids, PREFILL_SLICE):  # never through an image (its rows may see each other)
            piece, start = ids[start:end], end
            # The native engine is told which slice ends the prompt: a recurrent state is kept
            # one token before the prompt's end (a retry resumes there), not before each slice's.
            ends = end >= len(ids)
            call = (
                (lambda piece=piece, ends=ends: self.inner.prefill(piece, ends_prompt=ends))
                if self._joins
                else (lambda piece=piece: self.inner.prefill(piece))
            )
            logits = self.compute.run(_Pass(call=call, owner=self._owner()))
        assert logits is not None, "a prefill of nothing"
        return logits

    def score(self, ids: list[int]) -> torch.Tensor:
        return self.compute.run(_Pass(call=lambda: self.inner.score(ids), owner=self._owner()))

    def _owner(self) -> NativeBackend | None:
        """The sequence a call writes, preempted where it runs out of a paged pool's blocks."""
        return self.inner if self._joins else None

    def decode(self, token: torch.Tensor) -> torch.Tensor:
        if not self._joins:
            return self.compute.run(_Pass(call=lambda: self.inner.decode(token)))
        return self.compute.run(_Pass(backend=self.inner, token=token))

    def warm_up(self) -> float:
        return self.compute.run(_Pass(call=self.inner.warm_up))

    def crop(self, length: int) -> None:
        if isinstance(self.inner, PagedBackend):  # blocks let go: the pool's bookkeeping, shared
            self.compute.run(_Pass(call=lambda: self.inner.crop(length)))
            return
        self.inner.crop(length)

    def resumable(self, length: int) -> int:
        return self.inner.resumable(length)

    def reset(self) -> None:
        if isinstance(self.inner, PagedBackend):
            self.compute.run(_Pass(call=self.inner.reset))
            return
        self.inner.reset()

    def share_prefix(self, ids: list[int]) -> int:
        """A paged sequence, from empty, holding the blocks published for `ids`: how many it holds."""
        return self.compute.run(_Pass(call=lambda: self.inner.share_prefix(ids)))

    def release(self) -> None:
        self.compute.run(_Pass(call=self.inner.release))

    # On the compute thread too: a cache in a pool may grow, and a pool that grows moves every
    # slot's tensors, which no pass of another sequence may be using then.
    def save(self) -> Any:
        return self.compute.run(_Pass(call=self.inner.save))

    def restore(self, saved: Any) -> None:
        self.compute.run(_Pass(call=lambda: self.inner.restore(saved)))

    def copy_prefix(self, other: TakingTurns, length: int) -> int:
        """On the compute thread, after the passes already asked for: `other`'s positions
        below `length` are not written again before this copy runs, whatever its generation
        does meanwhile (its next pass waits behind this one)."""
        return self.compute.run(_Pass(call=lambda: self.inner.copy_prefix(other.inner, length)))


class Slots:
    """The engines generations run on: one per generation at once, each with its own cache
    over the shared weights, the caches slots of one pool (native/pool.py: one attention call
    per layer for a step's sequences). Taken and given back holding the compute thread's turn.

    The pool holds `kv_limit` bytes at most. It is as large as its slots in use times the longest
    bucket any of them needs, and keeps the size it reached (shrinking would move the running
    generations' caches). A generation reserves, as it starts, the positions its prompt and
    max_tokens may fill, so the pool never grows past the limit part way through a step and
    nothing running needs preempting; one whose reservation does not fit is refused
    (KVMemoryFull), and the running ones go on.

    With `paged` the caches are sequences of one paged pool of `kv_limit` bytes instead
    (native/paged_slots.py): nothing is reserved, a sequence takes blocks as it grows (one that
    finds none is preempted: ComputeThread._park), and a generation that ends lets its blocks go,
    kept for their content: a later prompt starting with the same text holds them again (`take`)."""

    def __init__(
        self,
        first: Engine,
        count: int,
        compute: ComputeThread,
        kv_limit: int | None = None,
        *,
        paged: bool = False,
    ) -> None:
        """With `count` 1 the engine is left as it is: its one generation at a time runs on
        the compute thread itself (as a call), with nothing to hand over per token, and its
        cache grows as far as the context (no `kv_limit`; `paged`: a pool of one context)."""
        backend = first.backend
        assert isinstance(backend, NativeBackend) or count == 1
        assert kv_limit is None or count > 1
        self.compute = compute
        self.kv_limit = kv_limit
        self.reserved: dict[int, int] = {}  # id(engine) → positions its running generation may fill
        self.pool: SlotPool | None = None
        self.engines: list[Engine] = [first]
        self.prefixes = first.prefixes  # one store: a conversation may come back in any slot
        self.prefixes.attach(first)
        self.batched: BatchedDecode | PagedSlots | None = None
        self.paged: PagedSlots | None = None
        if paged:
            graphed = backend.graphs is not None
            context = first.context_length
            # At most every slot's whole context: more would only keep ended requests' blocks,
            # and a pool is allocated whole (on a CPU, `kv_limit` defaults to half its memory).
            whole = count * backend.kv_bytes_for(context)
            self.paged = PagedSlots(backend.net, context, min(kv_limit or whole, whole), graphs=graphed)
            # What host copies would keep, the pool keeps as blocks shared by content.
            self.prefixes.budget_bytes = 0
            backend = self.paged.backend(backend.net)
            first.cached_ids = []
            first.backend = TakingTurns(backend, compute) if count > 1 else backend
            if count > 1:
                self.batched = compute.batched = self.paged
        elif count > 1:
            # Every slot's steps take the first's shapes: a CUDA graph per bucket where it has
            # them (a lone sequence's step as fast as one generation at a time), else eager.
            graphed, fixed = backend.graphs is not None, backend.static_shapes
            context = first.context_length
            self.pool = backend.net.new_pool(context)
            backend.cache = backend.net.new_cache(context, self.pool)  # its first slot
            first.cached_ids = []
            first.backend = TakingTurns(backend, compute)
            self.batched = BatchedDecode(backend.net, self.pool, graphs=graphed, static_shapes=fixed)
            compute.batched = self.batched
        for _ in range(count - 1):
            more = (
                self.paged.backend(backend.net)
                if self.paged is not None
                else NativeBackend(
                    None,
                    first.context_length,
                    net=backend.net,
                    pool=self.pool,
                    graphs=graphed,
                    static_shapes=fixed,
                )
            )
            engine = Engine(TakingTurns(more, compute), first.eos_token_ids, first.context_length)
            engine.prefixes = self.prefixes
            self.prefixes.attach(engine)
            self.engines.append(engine)
        self.free = list(self.engines)
        self.count = count
        # id(engine) → the prompt_cache_key it served last, and when (a count of keyed takes)
        self.claims: dict[int, tuple[str, int]] = {}
        self.taken = 0

    def take(self, prompt_ids: list[int], longest: int | None = None, cache_key: str | None = None) -> Engine:
        """The free engine whose cache shares the most with `prompt_ids` (the lowest slot
        among equals: the pool stays small), running from now on: a prefix another running
        generation's cache shares is copied into it as its generation starts (prefix.py).
        `longest`: the positions the generation may fill at most (default: the context), which
        it reserves. `cache_key` (a client's prompt_cache_key): see _keyed."""
        best = self._keyed(prompt_ids, cache_key)
        if self.kv_limit is not None and self.paged is None:
            # Room for a speculative check's rows past the last token too (cropped after it).
            wanted = (longest + GRAPHED_ROWS[-1]) if longest is not None else best.context_length
            self._reserve(best, min(wanted, best.context_length))
        self.free.remove(best)  # before the turn is given up below: no other request takes it
        if self.paged is not None and isinstance(best.backend, TakingTurns):
            # Its blocks were let go as its last generation ended: the ones published for this
            # prompt's text are held again, the prefix the prompt need not prefill (prefix.py
            # sees them as the engine's own cache).
            best.cached_ids = list(prompt_ids[: best.backend.share_prefix(prompt_ids)])
        self.prefixes.running(best, busy=True)
        if isinstance(best.backend, TakingTurns):
            self.compute.joined(best.backend.inner)
        return best

    def _keyed(self, prompt_ids: list[int], cache_key: str | None) -> Engine:
        """The engine for a request, honouring its client's cache key as a hint: the free slot
        that last served the key, else a free slot no key holds, else the one whose key was
        served longest ago. Conversations that share a long head (an agent's instructions)
        would otherwise take each other's slot for that head, and each next turn would find
        only the head there: the rest prefilled again, or brought back from a host copy
        (prefix.py) where one was set aside."""
        if cache_key is None:
            best = self.prefixes.slot_for(self.free, prompt_ids)
        else:
            own = [engine for engine in self.free if self.claims.get(id(engine), ("",))[0] == cache_key]
            unclaimed = [engine for engine in self.free if id(engine) not in self.claims]
            if own or unclaimed:
                best = own[0] if own else self.prefixes.slot_for(unclaimed, prompt_ids)
            else:
                best = min(self.free, key=lambda engine: self.claims[id(engine)][1])
        for engine_id, (key, _) in list(self.claims.items()):  # one slot per key: its latest
            if key == cache_key:
                del self.claims[engine_id]
        self.claims.pop(id(best), None)  # whatever key held it, its cache is rewritten now
        if cache_key is not None:
            self.taken += 1
            self.claims[id(best)] = (cache_key, self.taken)
        return best

    def _slot(self, engine: Engine) -> int:
        return self.engines.index(engine)

    def _reserve(self, engine: Engine, positions: int) -> None:
        """Count `positions` in for `engine`, or refuse them: the pool they would make, with
        the running ones', must fit the limit."""
        assert self.kv_limit is not None and self.pool is not None
        running = [other for other in self.engines if id(other) in self.reserved]
        slots = max(self._slot(other) for other in [*running, engine]) + 1
        longest = max([positions, *(self.reserved[id(other)] for other in running)])
        need = self._pool_bytes(slots, longest)
        if need > self.kv_limit:
            alone = self._pool_bytes(1, positions)  # with nothing else running (in the first slot)
            raise KVMemoryFull(_memory_full_message(positions, alone, need, self.kv_limit))
        self.reserved[id(engine)] = positions

    def _pool_bytes(self, slots: int, positions: int) -> int:
        """The pool's bytes (and the slots' rings' and recurrent states') with this many slots,
        room for `positions`."""
        assert self.pool is not None
        backend = self.engines[0].backend.inner  # type: ignore[attr-defined]
        cache = backend.cache
        if self.batched is not None and self.batched.fixed:
            slots += 1  # the scratch slot past them, where a padded step's spare rows write
        slots = max(slots, self.pool.slots)
        capacity = max(self.pool.capacity, cache.bucket_for(positions))
        return self.pool.bytes_for(slots, capacity) + slots * cache.bytes_beside_pool()

    def give_back(self, engine: Engine) -> None:
        if self.paged is not None and isinstance(engine.backend, TakingTurns):
            # Kept for their content (blocks.py) rather than held by an idle slot: evicted only
            # when memory is needed, and shared with any prompt that starts with the same text.
            engine.backend.release()
            engine.cached_ids = []
        self.reserved.pop(id(engine), None)
        self.prefixes.running(engine, busy=False)
        self.free.append(engine)


def _memory_full_message(positions: int, alone: int, beside: int, limit: int) -> str:
    """`alone`: the KV pool this request would need with nothing else running; `beside`: with
    the running ones."""
    from llmcli.models.memory import format_bytes

    if alone > limit:
        return (
            f"a request that may grow to {positions} tokens needs a KV pool of {format_bytes(alone)}, "
            f"more than the server's --kv-memory {format_bytes(limit)}: ask for fewer max_tokens"
        )
    return (
        f"the KV memory is taken: a request that may grow to {positions} tokens, beside the "
        f"generations running, needs a KV pool of {format_bytes(beside)}, more than --kv-memory "
        f"{format_bytes(limit)}: retry when one ends, or ask for fewer max_tokens"
    )
