"""What every route shares about a model served: the model and its threads (Served), a request's
place in its queue (Ticket), and a refusal in any protocol's error shape (RequestError)."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from llmcli.engine.scheduler import ComputeThread, Slots
from llmcli.errors import KVMemoryFull, LlmcliError
from llmcli.models.cpu_kernels import which_on
from llmcli.server.metrics import Metrics


@dataclass
class Served:
    """A model the server holds (server/fleet.py), and the one thread that runs it; the server's
    settings are every model's (one Served without a model holds them, for the guards)."""

    loaded: Any  # LoadedModel
    engine: Any  # Engine
    model_id: str
    api_key: str | None = None
    # The random id this server's runtime record holds: /health gives it, so that a call that
    # found the record knows the URL answers for that very server, not whatever took its port.
    instance: str = ""
    # Every forward pass, and the tokenizer's calls (engine/scheduler.py); the generations run in
    # threads of `generations`, taking turns, each on an engine of `slots`.
    worker: ComputeThread = field(default_factory=ComputeThread)
    slots: Slots | None = None
    generations: Executor = field(default_factory=lambda: ThreadPoolExecutor(1, "llmcli-gen"))
    # Per engine of `slots` (by id): what each `speculative` a request may name runs with there.
    speculations_of: dict[int, dict[str, Any]] = field(default_factory=dict)
    # What each `speculative` a request may name runs with ("draft" only with a draft model
    # loaded), and what a request that names none gets: the server's --speculative.
    speculations: dict[str, Any] = field(default_factory=lambda: {"off": None})
    speculative: str = "off"
    # Who may send requests (server/guard.py): the address it listens on, names for Host, origins.
    host: str = "127.0.0.1"
    allowed_hosts: tuple[str, ...] = ()
    cors: tuple[str, ...] = ()
    max_queue: int = 16  # generations waiting for the worker, at most: beyond, a 503
    # Whether the loaded model reads images: the one place every route asks (server/images.py
    # refuses each image of a request by its label where it does not).
    reads_images: bool = False
    allow_image_urls: bool = False  # --allow-image-urls: a request's http(s) image URLs are fetched
    drop_hosted_tools: bool = False  # --drop-hosted-tools: hosted tools left out, not refused
    quiet: bool = False  # no access log
    metrics: Metrics = field(default_factory=Metrics)
    waiting: int = 0  # generations submitted and not started yet
    lock: threading.Lock = field(default_factory=threading.Lock)
    stopping: threading.Event = field(default_factory=threading.Event)  # shutting down: stop all

    def admit(self) -> Ticket:
        """Count a request in from its arrival (it waits for the worker to tokenize, then to
        generate), or refuse it: the queue is bounded (--max-queue), and a stopping server
        takes nothing new."""
        if self.stopping.is_set():
            raise RequestError(503, "the server is shutting down", code="shutting_down")
        with self.lock:
            if self.waiting >= self.max_queue:
                message = (
                    f"the server is busy: {self.waiting} requests are waiting (--max-queue {self.max_queue})"
                )
                raise RequestError(503, message, code="queue_full", headers={"Retry-After": "5"})
            self.count_waiting(+1)
        return Ticket(self)

    @contextlib.contextmanager
    def turn_on_an_engine(
        self, prompt_ids: list[int], longest: int | None = None, cache_key: str | None = None
    ) -> Iterator[Any]:
        """A generation's turn, and the free engine that suits its prompt best. `longest`:
        the positions it may fill at most (its KV memory is reserved for them); `cache_key`:
        the client's prompt_cache_key, a hint for the slot (scheduler.Slots.take)."""
        with self.worker.generation():
            if self.slots is None:
                yield self.engine
                return
            try:
                engine = self.slots.take(prompt_ids, longest, cache_key)
            except KVMemoryFull as error:
                raise RequestError(
                    503, error.message, code="kv_memory_full", headers={"Retry-After": "5"}
                ) from None
            try:
                yield engine
            finally:
                self.slots.give_back(engine)

    def count_waiting(self, change: int) -> None:
        self.waiting += change
        self.metrics.waiting.inc(change)  # the server's gauge: every model's waiting requests

    def info(self) -> dict[str, Any]:
        loaded = self.loaded
        return {
            "model": self.model_id,
            "weight_bytes": loaded.weight_bytes,
            "device": str(loaded.device),
            "dtype": loaded.dtype_name,
            "quant": loaded.quant,
            "quant_backend": loaded.quant_backend,
            "cpu_kernels": which_on(loaded.device, loaded.quant),
            "engine": self.engine.name,
            "kv_bytes_per_token": loaded.kv_bytes_per_token,
            "context_length": loaded.context_length,
            "speculative": self.speculative,
            "instance": self.instance,
        }


class Ticket:
    """A request's place in the queue: given up when its generation starts, or when it ends
    without one (refused, failed, its client gone)."""

    def __init__(self, served: Served) -> None:
        self.served = served
        self.held = True

    def release(self) -> None:
        with self.served.lock:
            if self.held:
                self.held = False
                self.served.count_waiting(-1)


class RequestError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers


def describe(error: BaseException) -> str:
    if isinstance(error, LlmcliError):
        return error.one_line()
    if isinstance(error, RequestError):  # a stream's generation refused as it started
        return error.message
    return f"{type(error).__name__}: {error}"
