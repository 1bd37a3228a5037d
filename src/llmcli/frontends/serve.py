"""`llmcli serve`: load once, then answer OpenAI-compatible requests until stopped.

Only `llmcli serve` imports this module (and uvicorn with it). The socket is bound before the
server is announced, so a port in use is one clear line, and the
runtime record (server/runtime.py) exists only while something listens behind it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import ipaddress
import logging
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import uvicorn

from llmcli.config.settings import LoadSettings, SpeculativeSettings, check_api_key
from llmcli.engine.prefix import PrefixStore
from llmcli.engine.scheduler import ComputeThread, Slots
from llmcli.errors import EXIT_OK, LlmcliError, UsageError
from llmcli.frontends import terminal
from llmcli.frontends.loading import engine_with_feedback, load_with_feedback, speculation_with_feedback
from llmcli.frontends.prompt_cache import attach_disk_cache
from llmcli.server.runtime import MTP_DRAFTER, RecordWriter, model_identity

DEFAULT_PORT = 8471
# Generations at once by default on a CPU: 4 streams decode at 2.6× one stream's aggregate on
# the demo (2 cores), and more add less (the step alone: 8 at 3.5×, 4 at 2.8×) while each waits
# longer per token.
DEFAULT_PARALLEL = 4
# On a GPU, up to the largest batch the graphed step takes (engine/native/batched.py): a step
# reads the weights once for every row, and a batch-1 step is bound by reading them.
DEFAULT_PARALLEL_GPU = 16
T = TypeVar("T")


@dataclass(frozen=True)
class ServeRequest:
    model: str | None
    host: str
    port: int
    api_key: str | None
    load: LoadSettings
    speculative: SpeculativeSettings = field(default_factory=SpeculativeSettings)
    allowed_hosts: tuple[str, ...] = ()  # names a Host header may carry besides the address
    cors: tuple[str, ...] = ()  # web origins allowed to call it
    allow_image_urls: bool = False  # fetch the http(s) image URLs requests name (an SSRF otherwise)
    drop_hosted_tools: bool = False  # leave out a Responses request's hosted tools, not refuse it
    max_queue: int = 16  # generations waiting for the worker, at most
    parallel: int | None = None  # generations at once (None: _parallel's default)
    kv_memory: int | None = None  # bytes their caches may hold together (None: kv_memory_default)
    kv_layout: str | None = None  # "paged" or "slots" (None: _kv_layout's default)
    quiet: bool = False  # no access log
    idle_exit_s: float | None = None  # stop after this long without a request (keep-alive servers)
    models_max: int = 1  # models held at once: a request naming another swaps the idle one out


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_exposure(host: str, api_key: str | None) -> None:
    if not is_loopback(host) and not api_key:
        raise UsageError(
            f"--host {host} would let other machines use this model without a key",
            "set --api-key (or LLMCLI_API_KEY), or keep the default --host 127.0.0.1",
        )


def bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as error:
        sock.close()
        message = f"cannot listen on {host}:{port}: {error.strerror}"
        raise LlmcliError(message, "pick another --port") from None
    sock.listen(128)
    sock.set_inheritable(True)
    return sock


def run(request: ServeRequest) -> int:
    check_api_key(request.api_key)  # no client could send it: every request would be a 401
    check_exposure(request.host, request.api_key)
    sock = bind(request.host, request.port)  # before the load: a taken port fails in a second

    from llmcli.models.default_model import default_model_spec

    model_spec = request.model or default_model_spec()
    port = sock.getsockname()[1]
    shown_host = f"[{request.host}]" if ":" in request.host else request.host
    url = f"http://{shown_host}:{port}"
    # uvicorn shuts down gracefully, then re-raises the signal it caught: with this handler a
    # SIGTERM ends in SystemExit, so the `finally` below still removes the record — during the
    # load too (`llmcli stop` of a server still loading).
    signal.signal(signal.SIGTERM, _exit_quietly)
    # Announced as it starts, loading: `llmcli ps` lists it, `llmcli stop` stops it, and a call
    # made meanwhile waits for it rather than loading the model a second time.
    record: RecordWriter | None = None
    try:
        record = RecordWriter(
            local_url(request.host, port), model_spec, request.load, terminal.note,
            needs_key=bool(request.api_key), idle_exit_s=request.idle_exit_s,
            models_max=request.models_max,
        )  # fmt: skip
        return _load_and_serve(request, sock, model_spec, url, record)
    finally:
        if record is not None:
            record.remove()
        with contextlib.suppress(OSError):
            sock.close()


def _load_and_serve(
    request: ServeRequest, sock: socket.socket, model_spec: str, url: str, record: RecordWriter
) -> int:
    from llmcli.server.app import create_app
    from llmcli.server.fleet import Fleet
    from llmcli.server.state import Served

    # What every model's Served shares: who may call, the queue's bound, metrics, the shutdown.
    server = Served(
        loaded=None,
        engine=None,
        model_id="",
        api_key=request.api_key,
        host=request.host,
        allowed_hosts=request.allowed_hosts,
        cors=request.cors,
        allow_image_urls=request.allow_image_urls,
        drop_hosted_tools=request.drop_hosted_tools,
        max_queue=request.max_queue,
        quiet=request.quiet,
        instance=record.instance,
    )
    try:
        first = _serve_model(request, model_spec, server, request.speculative)
    except Exception as error:
        if request.idle_exit_s is not None:  # a keep-alive server: the next call says why, once
            from llmcli.server.runtime import write_failure

            write_failure(model_spec, error)
        raise
    # The model given at start alone drafts (--speculative draft or mtp: its draft model, its
    # head); every model loads with the same settings otherwise, and offers lookup.
    others = dataclasses.replace(request.speculative, method="off")
    fleet = Fleet(
        lambda spec: _serve_model(request, spec, server, others, beside_others=True),
        model_spec,
        request_catalog(),
        request.models_max,
        request.max_queue,
        identity=lambda spec: model_identity(spec) or spec,
        on_change=lambda: record.models(fleet.states()),
    )
    fleet.add(model_spec, first, set(names_of_spec(model_spec)))
    # Its name and file kept, not the model: once swapped out, nothing here holds its memory.
    name, weights_file, at_once = first.model_id, first.loaded.weights_file, _at_once(first.slots)
    del first
    app = fleet.tracking(create_app(fleet, server))
    clock = ActivityClock(app if weights_file is None else WatchedFile(app, weights_file))
    config = uvicorn.Config(
        clock, log_level="warning", access_log=False, lifespan="off", timeout_graceful_shutdown=5
    )
    uvicorn_server = StoppingServer(config, server.stopping)
    # asyncio's "socket.send() raised exception." when a client left mid-stream is not ours to
    # print: the generation stops at its next token, and the access log says how it ended.
    logging.getLogger("asyncio").setLevel(logging.CRITICAL)
    speculative = request.speculative
    drafter = {"draft": speculative.draft_model, "mtp": MTP_DRAFTER}.get(speculative.method)
    record.ready(name, drafter)
    clock.record = record
    idle_exit = request.idle_exit_s
    stops = "Ctrl-C stops"
    if idle_exit is not None:
        threading.Thread(target=_stop_when_idle, args=(uvicorn_server, clock, idle_exit), daemon=True).start()
        stops = f"stops after {idle_exit:g} s without a request"
    terminal.note(f"Serving {name} at {url}/v1 ({stops}; {at_once}).")
    try:
        uvicorn_server.run(sockets=[sock])
    except KeyboardInterrupt:
        pass  # Ctrl-C: uvicorn has finished the requests in flight; leaving is the point
    finally:
        for served in fleet.close():
            served.generations.shutdown(wait=False, cancel_futures=True)
            # Joined, not left running: a thread still in torch's code as the process ends can abort it.
            served.worker.shutdown(wait=True, cancel_futures=True)
    return EXIT_OK


def _serve_model(
    request: ServeRequest,
    model_spec: str,
    server: Any,
    speculative: SpeculativeSettings,
    beside_others: bool = False,
) -> Any:
    """One model loaded and ready to serve, on a compute thread of its own, with the server's
    shared settings (`server`, a Served without a model). `beside_others`: other models are
    serving meanwhile, and the load must not slow them (_load_quietly)."""
    # Every torch call of a model runs on its own compute thread, the first model's load
    # included. A second thread running torch's parallel ops starts a second OpenMP team; with
    # more workers than cores, libgomp's workers sleep between parallel regions instead of
    # spinning, and a decode step is hundreds of small regions: the demo decoded at 72 tok/s on
    # the 2 cores here against 141 in the thread that loaded it.
    worker = ComputeThread()
    try:
        mtp = speculative.method == "mtp"
        if beside_others:
            loaded, engine = _load_quietly(model_spec, request.load, mtp)
        else:
            loaded, engine = worker.submit(_load, model_spec, request.load, mtp).result()
    except BaseException:
        worker.shutdown(wait=True)
        raise
    engine.prefixes = PrefixStore(kept_budget(loaded.kv_bytes_per_token, loaded.context_length))
    attach_disk_cache(engine, loaded, request.load)  # a restarted server resumes its conversations
    kv_memory = request.kv_memory or kv_memory_default(engine.device)
    paged = _kv_layout(request, engine) == "paged"
    parallel = _parallel(request, engine, kv_memory, paged)
    paged = paged and (parallel > 1 or request.kv_layout == "paged")
    served = dataclasses.replace(
        server,
        loaded=loaded,
        engine=engine,
        model_id=loaded.name,
        worker=worker,
        # Images where the model has a vision part llmcli reads and the native engine runs it.
        reads_images=loaded.vision is not None and engine.name == "native",
        speculations_of={},
        speculations={"off": None},
        waiting=0,
        lock=threading.Lock(),
    )
    # Lookup costs nothing to offer, so any request may ask for it; drafting needs the model loaded.
    lookup = dataclasses.replace(speculative, method="lookup")
    speculations = served.speculations
    speculations["lookup"] = worker.submit(
        speculation_with_feedback, loaded, model_spec, lookup, request.load
    ).result()
    if speculative.method == "draft":
        speculations["draft"] = worker.submit(
            _privately, speculation_with_feedback, loaded, model_spec, speculative, request.load
        ).result()
    if speculative.method == "mtp":  # beside the one engine (a recurrent model: one sequence at once)
        speculations["mtp"] = worker.submit(
            speculation_with_feedback, loaded, model_spec, speculative, request.load, engine
        ).result()
    served.speculative = speculative.method
    served.slots = Slots(engine, parallel, worker, kv_memory if parallel > 1 else None, paged=paged)
    worker.on_step = served.metrics.step_sequences.observe
    worker.on_preempt = served.metrics.preempted.inc
    # One at a time: each generation runs on the compute thread itself, as before batching.
    if parallel > 1:
        served.generations = ThreadPoolExecutor(parallel, "llmcli-generation", initializer=_small_ops_alone)
    else:
        served.generations = worker
    for more in served.slots.engines[1:]:  # a lookup drafter follows one generation: one each
        served.speculations_of[id(more)] = {
            "off": None,
            "lookup": speculation_with_feedback(loaded, model_spec, lookup, request.load),
        }
    return served


def _at_once(slots: Any) -> str:
    """How many generations the first model runs at once, and where their keys and values live:
    the defaults depend on the device and the model (_parallel, _kv_layout), so the start says."""
    count = len(slots.engines)
    if count == 1:
        return "one generation at a time"
    layout = "paged blocks shared by content" if slots.paged is not None else "contiguous slots"
    return f"{count} generations at once, their keys and values in {layout}"


def request_catalog() -> Any:
    """The names a request may load a model by: the config file's aliases, and what `llmcli
    models list` shows (the default model's built-in name among them)."""
    from llmcli.config.user_config import load_user_config
    from llmcli.models.catalog import list_models
    from llmcli.models.default_model import DEFAULT_ALIAS, default_model_spec
    from llmcli.server.fleet import Catalog

    def listed() -> dict[str, str]:
        # A GGUF file not converted yet (the default's, before its first use) loads by its path.
        entries = {e.name: e.path if e.revision == "gguf file" else e.name for e in list_models()}
        return {DEFAULT_ALIAS: default_model_spec(), **entries}

    return Catalog(load_user_config().aliases, listed)


def names_of_spec(model_spec: str) -> list[str]:
    """The names the model given at start goes by (resolve.names_of), and the aliases that
    point at it: a request may call it by any of them."""
    from llmcli.config.user_config import load_user_config
    from llmcli.models.resolve import names_of

    names = names_of(model_spec)
    return [*names, *(alias for alias, target in load_user_config().aliases.items() if target in names)]


def local_url(host: str, port: int) -> str:
    """The URL other llmcli calls on this machine reach the server by: a server listening on
    every address (0.0.0.0, ::) is reached on loopback, the only kind of URL a record may send
    prompts to."""
    if host in ("0.0.0.0", ""):
        host = "127.0.0.1"
    elif host == "::":
        host = "::1"
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def _small_ops_alone() -> None:
    """A generation thread's torch calls (sampling over the vocabulary) run on that thread
    alone. Each thread that runs a parallel op starts an OpenMP team of its own, and with more
    OpenMP workers than cores libgomp's workers sleep between regions instead of spinning: the
    compute thread's decode steps ran at half speed once four generation threads had sampled
    (measured on the demo, 2 cores). torch's thread count is per thread once set, so the compute
    thread keeps its own."""
    import torch

    torch.set_num_threads(1)


def _kv_layout(request: ServeRequest, engine: Any) -> str:
    """Where the generations' keys and values live (native/paged_slots.py): --kv-layout, else
    paged on a GPU where the model takes it, else slots. One asked for and not honoured here is
    refused in one line."""
    from llmcli.engine.native.paged_slots import default_layout, paged_refusal

    asked = request.kv_layout
    if asked == "slots" or (asked is None and default_layout(engine.device) == "slots"):
        return "slots"
    refusal = paged_refusal(engine.backend)
    if refusal is None and request.speculative.method in ("draft", "mtp"):
        refusal = f"--kv-layout paged and --speculative {request.speculative.method} do not combine"
    if refusal is not None and asked is not None:
        raise UsageError(refusal)
    return "slots" if refusal is not None else "paged"


def _parallel(request: ServeRequest, engine: Any, kv_memory: int, paged: bool = False) -> int:
    """How many generations run at once: --parallel, else where the native engine batches its
    decode steps by default as many whole contexts as `kv_memory` holds, up to a cap: on a CPU
    (at most DEFAULT_PARALLEL), and on a GPU where the batched step replays as CUDA graphs
    (at most DEFAULT_PARALLEL_GPU; a lone sequence there replays its own step's graph, as fast
    as one at a time). Elsewhere 1: transformers' engine, a drafter holding one cache, and on a
    GPU without graphs (--no-fast) or a model whose batched step cannot take fixed shapes
    (batched.eager_reason), whose eager steps of several sequences are not measured there.
    `paged`: the generations' blocks share `kv_memory` as they grow (a sequence that finds none
    preempted), so it bounds no count of whole contexts; a paged step takes at most
    paged_slots.MOST_SEQUENCES."""
    from llmcli.engine.native.backend import NativeBackend
    from llmcli.engine.native.paged_slots import MOST_SEQUENCES

    native = isinstance(engine.backend, NativeBackend)
    one_cache = request.speculative.method in ("draft", "mtp")  # a drafter that holds one cache
    if request.parallel is None:
        most = _default_parallel(engine, paged) if native and not one_cache else 1
        if most == 1:
            if request.kv_memory is not None:
                raise UsageError(
                    "--kv-memory bounds the caches of generations run at once, and this server runs "
                    "one at a time by default here",
                    "add --parallel N (the native engine runs several by default on a CPU, and on a "
                    "GPU with graphs)",
                )
            return 1
        if paged:
            return min(most, MOST_SEQUENCES)
        whole_contexts = kv_memory // engine.backend.kv_bytes_for(engine.context_length)
        if _fixed_batches(engine):
            whole_contexts -= 1  # the scratch slot the padded step's spare rows write (batched.py)
        return max(1, min(most, whole_contexts))
    if request.parallel > 1 and not native:
        raise UsageError(
            f"--parallel {request.parallel} needs the native engine; this model runs on transformers'",
            "leave --parallel out (one generation at a time)",
        )
    if request.parallel > 1 and one_cache:
        method = request.speculative.method
        holder = "the draft model" if method == "draft" else "the MTP head"
        raise UsageError(
            f"--parallel and --speculative {method} do not combine: {holder} holds one cache",
            "use --speculative lookup, or leave --parallel out",
        )
    if paged and request.parallel > MOST_SEQUENCES:
        raise UsageError(
            f"--parallel {request.parallel}: a paged step takes at most {MOST_SEQUENCES} sequences",
            f"ask for --parallel {MOST_SEQUENCES} or fewer, or --kv-layout slots",
        )
    return request.parallel


def _default_parallel(engine: Any, paged: bool) -> int:
    """The most generations the native engine runs at once by default on its device: 1 where it
    does not batch them by default (a paged step is graphed for any model the paged pool takes)."""
    if engine.device.type == "cpu":
        return DEFAULT_PARALLEL
    graphed = engine.backend.graphs is not None
    return DEFAULT_PARALLEL_GPU if graphed and (paged or _fixed_batches(engine)) else 1


def _fixed_batches(engine: Any) -> bool:
    """Whether the native engine's steps of several sequences take fixed shapes (batched.py)."""
    from llmcli.engine.native.batched import eager_reason

    net = engine.backend.net
    return engine.backend.static_shapes and eager_reason(net, net.new_pool(engine.context_length)) is None


def kv_memory_default(device: Any) -> int:
    """The KV memory generations at once may hold by default: half the memory free once the
    model is loaded (of the GPU's, on one)."""
    import torch

    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0] // 2
    return _free_host_memory() // 2 or 1 << 30


def _free_host_memory() -> int:
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 0


def kept_budget(kv_bytes_per_token: int, context_length: int) -> int:
    """Host memory for conversations set aside (engine/prefix.py): one full context's worth, at
    most a quarter of the memory free now."""
    free = _free_host_memory()
    whole_context = kv_bytes_per_token * context_length
    return min(whole_context, free // 4) if free else whole_context


def _load_quietly(model_spec: str, settings: LoadSettings, mtp: bool) -> tuple[Any, Any]:
    """A load beside models that serve (on the fleet's loading thread): at the lowest CPU
    priority, with one torch thread (no OpenMP team of its own), so that the loaded models'
    decode steps keep the cores. Where a thread's priority cannot be set alone (not Linux),
    the load runs at the process's own."""
    import torch

    torch.set_num_threads(1)  # this thread's alone (_small_ops_alone)
    if sys.platform == "linux":  # a thread id is a "process" to setpriority there: this thread only
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    return _load(model_spec, settings, mtp)


def _load(model_spec: str, settings: LoadSettings, mtp: bool) -> tuple[Any, Any]:
    # Lean where it can (nothing the server runs needs transformers' model): a --keep-alive
    # server is up in about the time of an in-process call, not after transformers' load.
    loaded = _privately(load_with_feedback, model_spec, settings, lean=True, mtp=mtp)
    return loaded, engine_with_feedback(loaded)


def _privately(load: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """`load`, keeping nothing of a GGUF file mapped: a server outlives its load, and a file
    truncated under a mapping would kill it with SIGBUS at its next request, one overwritten in
    place would change its replies. The copies cost nothing on the demo (its tied head and
    embedding are int4 codes already) and a quantized embedding's or a float model's size
    elsewhere."""
    from llmcli.models.gguf_direct import private_copies

    with private_copies():
        return load(*args, **kwargs)


class WatchedFile:
    """The app, noticing before each request that the GGUF file the model was read from has
    changed on disk since, said once. The server keeps serving what it loaded (_privately: it
    holds its own copy) rather than stopping: its clients keep getting the model they were
    getting, and a restart is the user's call, named in the line."""

    def __init__(self, app: Any, path: Path) -> None:
        self.app, self.path = app, path
        self.loaded = model_identity(str(path))
        self.said = False

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if not self.said and scope["type"] == "http" and model_identity(str(self.path)) != self.loaded:
            self.said = True
            terminal.warning(
                f"{self.path} changed on disk after it was loaded; this server keeps serving the "
                "copy it loaded — restart it to load the new file"
            )
        await self.app(scope, receive, send)


class StoppingServer(uvicorn.Server):
    """uvicorn's server, which first tells every generation to stop: a shutdown cuts the replies
    in flight (their streams get an error event) and refuses waiting requests, rather than
    waiting them out."""

    def __init__(self, config: uvicorn.Config, stopping: threading.Event) -> None:
        super().__init__(config)
        self.stopping = stopping

    def handle_exit(self, sig: int, frame: object) -> None:
        self.stopping.set()
        super().handle_exit(sig, frame)


class ActivityClock:
    """The app, counting requests in flight and when the last one ended. Each ending touches the
    server's record, whose time `llmcli ps` reads as the server's idle time."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.in_flight = 0
        self.last = time.monotonic()
        self.record: Any = None
        self._lock = threading.Lock()

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        with self._lock:
            self.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            with self._lock:
                self.in_flight -= 1
                self.last = time.monotonic()
            if self.record is not None:
                self.record.touch()

    def idle_for(self) -> float:
        """Seconds since the last request ended; 0 while one is in flight."""
        with self._lock:
            return 0.0 if self.in_flight else time.monotonic() - self.last


def _stop_when_idle(server: uvicorn.Server, clock: ActivityClock, idle_exit_s: float) -> None:
    """A keep-alive server's end: after `idle_exit_s` without a request, a graceful stop."""
    while not server.should_exit:
        idle = clock.idle_for()
        if idle >= idle_exit_s:
            server.should_exit = True
            return
        time.sleep(min(1.0, idle_exit_s - idle))


def _exit_quietly(signum: int, frame: object) -> None:
    raise SystemExit(EXIT_OK)
