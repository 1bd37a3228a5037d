"""Several models in one server: which model a request names, loading it on first use, and
unloading what is least recently used, idle past its keep-alive, or in the way of a load.

A request names its model by any name `llmcli models list` shows, a configured alias, or a name
a held model already goes by (its served name, the spec it was loaded from). A path is never
taken from a request: the network does not choose what the server reads from disk; an alias
in the user's own config file may point at one. A name that is none of these is a 404 naming
it, with the nearest names (every protocol's routes ask here, through `serving`).

Each model has its own compute thread (engine/scheduler.py), and a load runs on a thread of its
own, off the event loop and off every loaded model's thread (at the lowest CPU priority:
frontends/serve.py): a request to a loaded model is answered while another loads. A request
to a model still loading waits for it; at most `max_queue` wait so. At most `models_max` models
are held: a load beyond it first unloads the least recently used idle one; one that does not fit
in memory unloads idle models too, and is refused with a 503 saying what it needs when none is
left to unload. An unloaded model's threads end and its memory is given back to the system.
"""

from __future__ import annotations

import asyncio
import contextvars
import difflib
import gc
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from llmcli.errors import LlmcliError, MemoryShortage
from llmcli.server.state import RequestError, Served, describe

# The models a request used, so that its end (whenever its body is sent) marks them idle again.
_used: contextvars.ContextVar[list[Held] | None] = contextvars.ContextVar("llmcli_used", default=None)


@dataclass
class Held:
    """A model this server holds, or is loading."""

    spec: str  # what it was loaded from (a catalog name, or an alias's target)
    names: set[str]  # every name a request may call it by
    key: str = ""  # its place in Fleet.held: what its spec named as it was loaded
    loaded: Future[Served] = field(default_factory=Future)
    last_used: float = field(default_factory=time.time)
    in_flight: int = 0  # requests using it now
    waiting: int = 0  # requests waiting for its load
    keep_alive_s: float | None = None  # unloaded this long after its last request (None: kept)
    expires_at: float | None = None  # then: when that is, while it is idle

    @property
    def idle(self) -> bool:
        return not self.in_flight and not self.waiting and self.served is not None

    @property
    def served(self) -> Served | None:
        """The model, once loaded (None while it loads, or when its load failed)."""
        done = self.loaded.done() and self.loaded.exception() is None
        return self.loaded.result() if done else None

    def state(self, now: float) -> dict[str, Any]:
        """What /v1/models, /api/ps and the runtime record say of it."""
        served = self.served
        idle = None if self.in_flight or served is None else round(max(0.0, now - self.last_used), 1)
        return {
            "name": served.model_id if served is not None else self.spec,
            "spec": self.spec,
            "state": "loaded" if served is not None else "loading",
            "idle_s": idle,
            "weight_bytes": served.loaded.weight_bytes if served is not None else None,
            "device": str(served.loaded.device) if served is not None else None,
            "quant": served.loaded.quant if served is not None else None,
            "expires_at": self.expires_at,
        }


@dataclass(frozen=True)
class Catalog:
    """The names a request may load a model by: `aliases` (name → spec, from the config file) and
    `listed()` (the names `llmcli models list` shows, read when asked: a scan of the caches)."""

    aliases: dict[str, str]
    listed: Callable[[], dict[str, str]]  # name → the spec that loads it

    def spec_for(self, name: str) -> str | None:
        return self.aliases[name] if name in self.aliases else self.listed().get(name)


class Fleet:
    """The models one server holds, by name; every route asks `serving` for its request's."""

    def __init__(
        self,
        load: Callable[[str], Served],
        default_spec: str,
        catalog: Catalog,
        models_max: int,
        max_queue: int,
        identity: Callable[[str], Any] = lambda spec: spec,
        on_change: Callable[[], None] = lambda: None,
    ) -> None:
        self._load, self.catalog, self.models_max, self.max_queue = load, catalog, models_max, max_queue
        self.default_spec = default_spec  # what a request naming no model loads when none is held
        self._identity = identity  # what makes two specs one model (a path's file, not its spelling)
        self._on_change = on_change  # the runtime record rewritten
        self.held: OrderedDict[str, Held] = OrderedDict()  # least recently used first
        self._lock = threading.RLock()
        self._expiry = threading.Condition(self._lock)
        self.closed = False
        threading.Thread(target=self._unload_expired, name="llmcli-keep-alive", daemon=True).start()

    # Finding a model -------------------------------------------------------------------------

    async def serving(self, name: str | None) -> Served:
        """The model a request names (None: the most recently used one), loaded if need be; the
        request counts as using it until its answer is sent (`Fleet.tracking`)."""
        held = self._held_for(name)
        try:
            served = await asyncio.wrap_future(held.loaded)
        except RequestError:
            raise
        except MemoryShortage as error:
            raise RequestError(503, error.one_line(), "model", "insufficient_memory") from None
        except LlmcliError as error:
            raise RequestError(400, f"model {name!r} cannot be loaded: {error.one_line()}", "model") from None
        except Exception as error:  # the load crashed: said, and tried again by the next request
            raise RequestError(500, f"model {name!r} failed to load: {describe(error)}", "model") from None
        finally:
            self._waited(held)
        return served

    def _held_for(self, name: str | None) -> Held:
        with self._lock:
            held = self._find(name)
            if held is None:
                held = self._start_loading(name)
            elif not held.loaded.done() and held.waiting >= self.max_queue:
                message = f"{self.max_queue} requests already wait for {name!r} to load (--max-queue)"
                raise RequestError(503, message, "model", "queue_full", {"Retry-After": "5"})
            held.waiting += 1
            held.last_used = time.time()
            self.held.move_to_end(held.key)
            return held

    def _find(self, name: str | None) -> Held | None:
        if not name:
            return next(reversed(self.held.values()), None)
        for held in self.held.values():
            if name in held.names:
                return held
        spec = self.catalog.spec_for(name)
        return self.held.get(self._key(spec)) if spec is not None else None

    def _start_loading(self, name: str | None) -> Held:
        spec = self.catalog.spec_for(name) if name else self.default_spec
        if spec is None:
            raise self.not_here(name or "")
        held = Held(spec, {name, spec} if name else {spec}, self._key(spec))
        self.held[held.key] = held
        threading.Thread(target=self._load_into, args=(held,), name="llmcli-load", daemon=True).start()
        self._changed()
        return held

    def not_here(self, name: str) -> RequestError:
        known = sorted({*self.catalog.aliases, *self.catalog.listed(), *self.names()})
        nearest = difflib.get_close_matches(name, known, n=3, cutoff=0.5)
        hint = f"; the nearest: {', '.join(nearest)}" if nearest else ""
        holding = ", ".join(repr(state["name"]) for state in self.states()) or "none"
        message = (
            f"no model {name!r} here{hint} (this server holds {holding}; GET /v1/models lists "
            "those it may load by name)"
        )
        return RequestError(404, message, "model", "model_not_found")

    def _changed(self) -> None:
        with self._lock:  # one writer at a time: the record says the latest states, not older ones
            self._on_change()

    def _key(self, spec: str) -> str:
        return repr(self._identity(spec))

    # Loading and unloading -------------------------------------------------------------------

    def add(self, spec: str, served: Served, names: set[str]) -> None:
        """The model loaded at start, held as if a request had loaded it."""
        held = Held(spec, {spec, served.model_id, *names}, self._key(spec))
        held.loaded.set_result(served)
        with self._lock:
            self.held[held.key] = held
        self._changed()

    def _load_into(self, held: Held) -> None:
        """On a thread of its own: room made (--models-max), then the load, retried after
        unloading idle models while it does not fit in memory."""
        try:
            self._make_room(held)
            while True:
                try:
                    served = self._load(held.spec)
                    break
                except MemoryShortage:
                    if not self._unload_one_idle(keep=held):
                        raise
        except BaseException as error:
            with self._lock:
                self.held.pop(held.key, None)
            held.loaded.set_exception(error)
            self._changed()
            return
        with self._lock:
            held.names.add(served.model_id)
            held.last_used = time.time()
        held.loaded.set_result(served)
        self._changed()

    def _make_room(self, held: Held) -> None:
        with self._lock:
            over = len(self.held) - self.models_max
        for _ in range(over):
            if not self._unload_one_idle(keep=held):
                busy = ", ".join(repr(state["name"]) for state in self.states() if state["spec"] != held.spec)
                message = (
                    f"--models-max {self.models_max}: every model held is answering requests ({busy}); "
                    "retry once they finish, or start the server with a larger --models-max"
                )
                raise RequestError(503, message, "model", "models_busy", {"Retry-After": "5"})

    def _unload_one_idle(self, keep: Held) -> bool:
        """Unload the least recently used idle model; False when none is idle."""
        with self._lock:
            idle = [held for held in self.held.values() if held is not keep and held.idle]
            if not idle:
                return False
            self.held.pop(idle[0].key)
        release(idle[0])
        self._changed()
        return True

    def unload(self, held: Held) -> None:
        """Unload `held` now if it is idle, else as its last request ends."""
        with self._lock:
            held.keep_alive_s = 0.0
            if not held.idle or self.held.get(held.key) is not held:
                return
            self.held.pop(held.key)
        release(held)
        self._changed()

    # Use and keep-alive -----------------------------------------------------------------------

    def _waited(self, held: Held) -> None:
        """A request's wait for its model over: counted in use until its answer is sent (`tracking`)
        in the same step, so that no unload finds the model idle in between."""
        used = _used.get()
        with self._lock:
            held.waiting -= 1
            if held.served is not None and used is not None:
                held.in_flight += 1
                held.last_used = time.time()
                used.append(held)

    def _done_with(self, held: Held) -> None:
        with self._lock:
            held.in_flight -= 1
            held.last_used = time.time()
            if held.keep_alive_s is not None:
                held.expires_at = held.last_used + held.keep_alive_s
            now = held.keep_alive_s == 0 and held.idle
            self._expiry.notify_all()
        if now:
            self.unload(held)

    def keep_alive(self, served: Served, seconds: float) -> None:
        """Ollama's keep_alive of a request: its model unloaded `seconds` after its last request
        ends (0: as soon as this one ends; negative: kept for the server's life). A request
        without one leaves the model's as it was."""
        with self._lock:
            for held in self.held.values():
                if held.served is served:
                    held.keep_alive_s = None if seconds < 0 else seconds
                    held.expires_at = None

    def _unload_expired(self) -> None:
        """The keep-alive thread: each model idle past its expiry unloaded."""
        while True:
            with self._lock:
                if self.closed:
                    return
                now = time.time()
                idle = [held for held in self.held.values() if held.expires_at is not None and held.idle]
                due = [held for held in idle if (held.expires_at or 0) <= now]
                if not due:
                    later = [held.expires_at or 0 for held in idle]
                    self._expiry.wait(min(later) - now if later else None)
                    continue
            for held in due:  # outside the lock: a model's threads end before it is gone
                self.unload(held)

    def tracking(self, app: Any) -> Any:
        """The app, with each request's models counted as in use until its answer is sent."""

        async def counted(scope: Any, receive: Any, send: Any) -> None:
            if scope["type"] != "http":
                await app(scope, receive, send)
                return
            used: list[Held] = []
            token = _used.set(used)
            try:
                await app(scope, receive, send)
            finally:
                _used.reset(token)
                for held in used:
                    self._done_with(held)

        return counted

    # Reports ----------------------------------------------------------------------------------

    def listing(self) -> list[dict[str, Any]]:
        """The models held (most recently used first), then those a request may load by name."""
        held = self.states()
        taken = self.names()
        available = sorted({*self.catalog.aliases, *self.catalog.listed()} - taken)
        return [*held, *({"name": name, "state": "available"} for name in available)]

    def names(self) -> set[str]:
        with self._lock:
            return {name for held in self.held.values() for name in held.names}

    def states(self) -> list[dict[str, Any]]:
        """Each model held, most recently used first."""
        now = time.time()
        with self._lock:
            return [held.state(now) for held in reversed(self.held.values())]

    def loaded(self) -> Iterator[Served]:
        with self._lock:
            models = [held.served for held in reversed(self.held.values())]
        return (served for served in models if served is not None)

    def close(self) -> list[Served]:
        """The server's end: the keep-alive thread stopped; the models, for their threads' end."""
        with self._lock:
            self.closed = True
            self._expiry.notify_all()
        return list(self.loaded())


def release(held: Held) -> None:
    """A model's threads ended once their generations finish, and its memory freed."""
    served = held.served
    if served is None:
        return
    if served.generations is not served.worker:
        served.generations.shutdown(wait=True)
    served.worker.shutdown(wait=True)
    served.loaded = served.engine = served.slots = None
    served.speculations_of.clear()
    served.speculations.clear()
    held.loaded = Future()
    gc.collect()
    _give_back_to_the_system()
    import torch

    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _give_back_to_the_system() -> None:
    """glibc keeps freed memory in the arena of the thread that used it (each load and compute
    thread has its own): trimmed, a swapped-out model's memory leaves the process."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    if name is None:
        return
    trim = getattr(ctypes.CDLL(name), "malloc_trim", None)  # glibc's alone
    if trim is not None:
        trim(0)
