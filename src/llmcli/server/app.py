"""The HTTP API over one loaded model (FastAPI on uvicorn): OpenAI's chat and text completions
here, and the Responses, Anthropic and Ollama APIs as adapters that translate to and from them
(responses.py, anthropic.py, ollama.py).

One worker thread runs every generation, in arrival order: batch-1 decode is bound by reading
the weights, so two generations at once would each run at half speed and share one KV cache.
That thread owns the engine, whose cache persists between requests: a request whose prompt
starts with what the cache holds (the next turn of a chat, re-sent whole by any client) prefills
only the rest, and `usage.prompt_tokens_details.cached_tokens` says how much was reused.

A client that goes away stops its generation at the next token (the engine's cache is cropped
back to what it holds exactly, as after Ctrl-C); one still waiting in the queue is skipped, and
the queue is bounded. Every failure is an error object in the protocol's own shape, and the
worker lives on.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from llmcli.config.settings import SamplingParams, SamplingSettings
from llmcli.engine.reasoning import REASONING, thinking_of
from llmcli.engine.reply import TOOL_CALL, ReplyStream
from llmcli.engine.scheduler import ComputeThread, Slots
from llmcli.engine.tools.reader import CallArguments, CallStart
from llmcli.errors import KVMemoryFull, LlmcliError
from llmcli.server.anthropic import install_anthropic
from llmcli.server.guard import HostGuard, JsonOnly, KeyGuard, NestingLimit
from llmcli.server.logprobs import chat_logprobs, completion_logprobs, score_prompt
from llmcli.server.metrics import Metrics, Observed
from llmcli.server.ollama import install_ollama
from llmcli.server.protocol import ChatRequest, CompletionRequest, _Sampling, error_body, error_for
from llmcli.server.responses import install_responses

if TYPE_CHECKING:
    from llmcli.engine.structured import OutputFormat
    from llmcli.engine.tools import ToolCall
    from llmcli.engine.tools.turn import ToolTurn

T = TypeVar("T")
MAX_BODY_BYTES = 8 << 20  # a prompt of ~2M tokens: larger is a mistake, not a prompt
LOGPROBS, ECHO = "logprobs", "echo"  # the stream's channels beside text and tool calls
DISCONNECT_POLL_S = 0.1  # how often a non-streaming request checks that its client is still there


@dataclass
class Served:
    """The model behind the server, and the one thread that runs it."""

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
    def turn_on_an_engine(self, prompt_ids: list[int], longest: int | None = None) -> Iterator[Any]:
        """A generation's turn, and the free engine that suits its prompt best. `longest`:
        the positions it may fill at most (its KV memory is reserved for them)."""
        with self.worker.generation():
            if self.slots is None:
                yield self.engine
                return
            try:
                engine = self.slots.take(prompt_ids, longest)
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
        self.metrics.waiting.set(self.waiting)

    def info(self) -> dict[str, Any]:
        loaded = self.loaded
        return {
            "model": self.model_id,
            "weight_bytes": loaded.weight_bytes,
            "device": str(loaded.device),
            "dtype": loaded.dtype_name,
            "quant": loaded.quant,
            "quant_backend": loaded.quant_backend,
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


@dataclass
class Outcome:
    text: str  # the answer
    finish_reason: str
    stats: Any  # GenerationStats
    sampling: dict[str, Any]
    reasoning: str | None = None  # a reasoning model's thinking; None for a model that does not think
    reasoning_tokens: int | None = None
    tool_calls: list[ToolCall] = field(default_factory=list)
    logprobs: list[Any] | None = None  # asked for: one TokenLogprob per completion token
    prompt_ids: list[int] = field(default_factory=list)  # with echo: the prompt, scored
    prompt_logprobs: list[Any] | None = None
    token_ids: list[int] = field(default_factory=list)
    stop_sequence: str | None = None  # the stop string that ended the reply, if one did


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


def create_app(served: Served) -> ASGIApp:
    app = FastAPI(title="llmcli", docs_url=None, redoc_url=None, openapi_url=None)
    _install_error_handlers(app)

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok", **served.info()}

    @app.get("/metrics")
    async def metrics() -> Response:
        from prometheus_client import CONTENT_TYPE_LATEST

        return Response(served.metrics.text(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> dict[str, Any]:
        if model_id != served.model_id:
            raise RequestError(
                404, f"no model {model_id!r} here: this server runs {served.model_id!r}", "model"
            )
        return {"id": served.model_id, "object": "model", "created": 0, "owned_by": "llmcli"}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {
            "object": "list",
            "data": [{"id": served.model_id, "object": "model", "created": 0, "owned_by": "llmcli"}],
        }

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatRequest, request: Request) -> Any:
        return await chat_response(served, request, body)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Any:
        return await completion_response(served, request, body)

    install_ollama(app, served)
    install_anthropic(app, served)
    install_responses(app, served)

    guarded: ASGIApp = KeyGuard(JsonOnly(NestingLimit(app)), served.api_key)
    if served.cors:
        from starlette.middleware.cors import CORSMiddleware

        guarded = CORSMiddleware(
            guarded, allow_origins=list(served.cors), allow_methods=["*"], allow_headers=["*"]
        )
    limited = BodyLimit(HostGuard(guarded, served.host, served.allowed_hosts, served.cors), MAX_BODY_BYTES)
    return Observed(limited, served.metrics, served.quiet)


async def chat_response(
    served: Served, request: Request, body: ChatRequest, continue_final: bool = False
) -> Any:
    """A chat request answered, in OpenAI's shape (a dict, or a stream of server-sent events):
    what every protocol's chat route translates to and from. `request.state.prompt_tokens`
    says how long the prompt is, for a stream that reports it as it starts (Anthropic's)."""
    request.state.ticket = ticket = served.admit()  # given back by the worker or the error handler
    ids, turn = await chat_prompt(served, body, continue_final)
    request.state.prompt_tokens = len(ids)
    return await _respond(served, request, body, [ids], ticket, chat=True, tools=turn)


async def chat_prompt(
    served: Served, body: ChatRequest, continue_final: bool = False
) -> tuple[list[int], ToolTurn]:
    """The prompt's token ids as the template renders the request (its tools too); every
    request the template or the tools refuse is a 400 that says why. `continue_final`: the
    last message is the assistant's, for the reply to continue (Anthropic's prefill)."""
    from llmcli.engine.conversation import prompt_ids
    from llmcli.engine.tools.turn import tool_turn

    try:
        tools = body.tool_request()
    except LlmcliError as error:
        param = error.message.split(":")[0] if not body.functions else "functions"
        raise RequestError(400, error.message, param) from None
    if tools is not None and tools.callable and body.response_format is not None:
        message = "tool calls and response_format at once are not supported: send one of them"
        raise RequestError(400, message, "response_format")

    options = dict(body.chat_template_kwargs or {})
    if body.reasoning_effort is not None:
        template = str(getattr(served.loaded.tokenizer, "chat_template", "") or "")
        if "reasoning_effort" not in template:  # accepted and ignored would be a silent failure
            message = "this model's chat template does not read reasoning_effort"
            raise RequestError(400, message, "reasoning_effort")
        options["reasoning_effort"] = body.reasoning_effort

    def tokenize() -> tuple[list[int], ToolTurn]:
        loaded = served.loaded
        tokenizer = loaded.tokenizer
        try:
            turn = tool_turn(tokenizer, body.chat_messages(), tools, loaded.vocab_size, loaded.eos_token_ids)
            ids = prompt_ids(
                tokenizer,
                turn.messages,
                think_off=body.think_off,
                options=options | turn.options,
                context_length=loaded.context_length,
                continue_final=continue_final,
            )
        except LlmcliError as error:  # a template that refuses them, a tool result that answers no call
            raise RequestError(400, error.message, "messages") from None
        return ids, turn

    return await _on_worker(served, tokenize)


async def completion_response(served: Served, request: Request, body: CompletionRequest) -> Any:
    """A text completion answered, in OpenAI's shape."""
    ticket = request.state.ticket = served.admit()
    loaded = served.loaded

    def tokenize() -> list[list[int]]:
        try:
            prompts = body.prompt_ids(loaded.tokenizer, loaded.context_length)
            body.check_ids(prompts, loaded.vocab_size)
        except LlmcliError as error:
            raise RequestError(400, error.message, "prompt") from None
        return prompts

    prompts = await _on_worker(served, tokenize)
    if body.scores_only:
        return await _scores_only(served, body, prompts, ticket)
    return await _respond(served, request, body, prompts, ticket, chat=False)


async def _on_worker(served: Served, work: Callable[[], T]) -> T:
    """Tokenize on the worker thread: a Rust tokenizer used from two threads at once can fail
    ("Already borrowed"), and the worker is using it to detokenize."""
    return await asyncio.get_running_loop().run_in_executor(served.worker, work)


@dataclass(frozen=True)
class Job:
    """One generation as the worker runs it."""

    ids: list[int]
    sampling: SamplingSettings
    speculative: str
    output: OutputFormat | None
    chat: bool
    ticket: Ticket
    tools: ToolTurn | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()
    logprobs: int | None = None  # alternatives per token to report (0: the chosen one's only)
    echo: bool = False  # completions: the prompt and its logprobs first
    think_budget: int | None = None  # a reasoning model thinks this many tokens at most
    # Another choice of the same prompt, set once its prompt is in its cache: this one starts
    # then, to copy that prompt from it rather than prefill it again (scheduler.Slots).
    after: threading.Event | None = None
    prompt_cached: threading.Event = field(default_factory=threading.Event)


async def _respond(
    served: Served,
    request: Request,
    body: _Sampling,
    prompts: list[list[int]],
    ticket: Ticket,
    *,
    chat: bool,
    tools: ToolTurn | None = None,
) -> Any:
    """One choice per prompt and per `n`: generated together where the server runs several
    generations at once, streamed or not. A request that sets no limit gets the model's
    generation_config.json's, else the built-in 512 tokens, as the CLI does: each generation
    reserves the KV memory its limit may fill, so "up to the context" is asked for, never a
    default (`request.state.to_context_end`: Ollama's num_predict -1)."""
    sampling = _checked_sampling(body)
    if sampling.max_new_tokens is None and getattr(request.state, "to_context_end", False):
        room = served.loaded.context_length - max(len(ids) for ids in prompts)
        sampling = replace(sampling, max_new_tokens=max(room, 1))  # a prompt with no room: refused below
    method = body.speculative or served.speculative
    if method not in served.speculations:
        raise RequestError(400, "this server has no draft model: start it with --draft-model", "speculative")
    output = tools.output if tools is not None else None
    if body.response_format is not None:
        try:
            output = body.response_format.output()
        except LlmcliError as error:
            raise RequestError(400, error.message, "response_format") from None
    for ids in prompts:
        _check_fits(served, ids, sampling, chat)
    try:
        bias = body.bias(served.loaded.vocab_size)
    except LlmcliError as error:
        raise RequestError(400, error.message, "logit_bias") from None
    logprobs, echo = _logprobs_asked(body, method)
    budget = getattr(body, "think_budget", None)
    if budget is not None and thinking_of(served.loaded.tokenizer) is None:
        message = "a thinking budget needs a model that thinks, and this model's template marks none"
        raise RequestError(400, message, "think_budget")
    jobs = [
        Job(ids, _sample(sampling, k), method, output, chat, ticket, tools, bias, logprobs, echo, budget)
        for ids in prompts
        for k in range(body.n)
    ]
    if served.slots is not None and served.slots.count > 1:
        first_of: dict[tuple[int, ...], Job] = {}
        for index, job in enumerate(jobs):  # started in this order: the one waited for has a thread
            first = first_of.setdefault(tuple(job.ids), job)
            if first is not job:
                jobs[index] = replace(job, after=first.prompt_cached)
    request_id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
    created = int(time.time())
    if body.stream:
        return StreamingResponse(
            _stream(served, request, jobs, request_id, created, body.include_usage),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
    # Every choice at once: with --parallel above 1 their decode steps run together.
    finished = await asyncio.gather(*(_run_while_connected(served, request, job) for job in jobs))
    if None in finished and served.stopping.is_set():
        raise RequestError(503, "the server is shutting down: this reply was cut", code="shutting_down")
    if None in finished:  # nobody is there to read an answer
        return Response(status_code=499)
    outcomes = [outcome for outcome in finished if outcome is not None]
    request.state.usage = _token_counts(outcomes)
    return _completion(served, request_id, created, outcomes, chat)


def _sample(sampling: SamplingSettings, k: int) -> SamplingSettings:
    """The k-th of n choices: a given seed moves on by k, so that the choices differ."""
    return sampling if k == 0 or sampling.seed is None else replace(sampling, seed=sampling.seed + k)


def _check_fits(served: Served, ids: list[int], sampling: SamplingSettings, chat: bool) -> None:
    context = served.loaded.context_length
    if len(ids) >= context:
        message = f"the prompt is {len(ids)} tokens; the context holds {context}"
        raise RequestError(400, message, "messages" if chat else "prompt", "context_length_exceeded")
    if sampling.max_new_tokens is not None and len(ids) + sampling.max_new_tokens > context:
        message = (
            f"max_tokens {sampling.max_new_tokens} with a {len(ids)}-token prompt "
            f"exceeds the context of {context}"
        )
        raise RequestError(400, message, "max_tokens", "context_length_exceeded")


async def _run_while_connected(served: Served, request: Request, job: Job) -> Outcome | None:
    """A non-streaming generation; a client that leaves stops it at the next token (or before
    it starts)."""
    cancelled = threading.Event()
    work = functools.partial(_generate, served, job, None, cancelled)
    future = asyncio.get_running_loop().run_in_executor(served.generations, work)
    while not (await asyncio.wait({future}, timeout=DISCONNECT_POLL_S))[0]:
        if await request.is_disconnected():
            cancelled.set()
    return await future


def _token_counts(outcomes: list[Outcome]) -> tuple[int, int]:
    return (
        sum(outcome.stats.prompt_tokens for outcome in outcomes),
        sum(outcome.stats.completion_tokens for outcome in outcomes),
    )


async def _scores_only(
    served: Served, body: CompletionRequest, prompts: list[list[int]], ticket: Ticket
) -> Any:
    """max_tokens 0 with echo: each prompt's tokens and their logprobs, nothing generated (how
    lm-eval asks for a loglikelihood)."""
    if not body.echo:
        raise RequestError(400, "max_tokens 0 generates nothing: it needs echo: true", "max_tokens")
    for ids in prompts:
        if len(ids) > served.loaded.context_length:
            message = f"the prompt is {len(ids)} tokens; the context holds {served.loaded.context_length}"
            raise RequestError(400, message, "prompt", "context_length_exceeded")

    def score() -> list[list[Any]]:
        with served.turn_on_an_engine(prompts[0], max(len(ids) for ids in prompts)) as engine:
            ticket.release()
            return [score_prompt(engine, ids, body.logprobs or 0) for ids in prompts]

    scored = await asyncio.get_running_loop().run_in_executor(served.generations, score)
    tokenizer = served.loaded.tokenizer
    choices = []
    for index, (ids, entries) in enumerate(zip(prompts, scored, strict=True)):
        logprobs = completion_logprobs(tokenizer, ids, entries) if body.logprobs is not None else None
        choices.append(
            {"index": index, "text": tokenizer.decode(ids), "finish_reason": "length", "logprobs": logprobs}
        )
    total = sum(len(ids) for ids in prompts)
    return {
        "id": "cmpl-" + uuid.uuid4().hex[:24],
        "object": "text_completion",
        "created": int(time.time()),
        "model": served.model_id,
        "choices": choices,
        "usage": {"prompt_tokens": total, "completion_tokens": 0, "total_tokens": total},
    }


def _logprobs_asked(body: _Sampling, method: str) -> tuple[int | None, bool]:
    """(alternatives per token or None, echo): chat's logprobs/top_logprobs, completions'
    logprobs N and echo. Drafts are checked several at a time: not with logprobs."""
    if isinstance(body, ChatRequest):
        try:
            count, echo = body.logprob_count(), False
        except LlmcliError as error:
            raise RequestError(400, error.message, "top_logprobs") from None
    else:
        count, echo = getattr(body, "logprobs", None), bool(getattr(body, "echo", False))
    if count is not None and body.speculative not in (None, "off"):
        raise RequestError(400, "logprobs and speculative decoding do not combine", "speculative")
    return count, echo


def _checked_sampling(body: _Sampling) -> SamplingSettings:
    sampling = body.sampling()
    try:
        sampling.validate("request")
    except LlmcliError as error:
        raise RequestError(400, error.message) from None
    return sampling


def _generate(
    served: Served, job: Job, on_piece: Callable[[str, Any], None] | None, cancelled: threading.Event
) -> Outcome | None:
    """On a generation thread, in its turn: one generation, start to end (None when its
    client left first). `on_piece` gets (channel, piece): reasoning or content text, or a part
    of a tool call."""
    if job.after is not None:
        job.after.wait()
    params = job.sampling.resolve(served.loaded.generation_config).with_(logit_bias=job.logit_bias)
    try:
        with served.turn_on_an_engine(job.ids, len(job.ids) + params.max_new_tokens) as engine:
            return _generate_on(served, engine, job, params, on_piece, cancelled)
    finally:
        job.prompt_cached.set()  # however it ended: a choice waiting for it goes on


def _generate_on(
    served: Served,
    engine: Any,
    job: Job,
    params: SamplingParams,
    on_piece: Callable[[str, Any], None] | None,
    cancelled: threading.Event,
) -> Outcome | None:
    job.ticket.release()
    if cancelled.is_set() or served.stopping.is_set():
        served.metrics.cancelled.inc()
        return None
    loaded = served.loaded
    engine.speculation = served.speculations_of.get(id(engine), served.speculations)[job.speculative]
    constraint = None
    if job.output is not None:  # here: llguidance reads the tokenizer, which only this thread uses
        from llmcli.engine.structured.constraint import Constraint

        constraint = Constraint(job.output, loaded.tokenizer, loaded.vocab_size, loaded.eos_token_ids)
    reader = job.tools.reader() if job.tools is not None else None
    prompt_logprobs = None
    if job.echo:  # the prompt scored in one pass; the generation then reuses the cache
        prompt_logprobs = score_prompt(engine, job.ids, job.logprobs or 0)
        if on_piece is not None:
            on_piece(ECHO, prompt_logprobs)
    generation = engine.generate(
        job.ids, params, loaded.tokenizer, constraint, job.think_budget, reader is not None, job.logprobs
    )
    sent = 0  # logprobs streamed so far
    # A chat's reply is split into thinking, answer and calls; a text completion's is the text.
    stream = ReplyStream(loaded.tokenizer if job.chat else None, job.ids, reader)
    try:
        for channel, piece in stream.split(generation):
            job.prompt_cached.set()  # a token came: the prompt is in the cache
            if cancelled.is_set() or served.stopping.is_set():
                generation.interrupt()
                break
            if on_piece is not None and job.logprobs is not None:
                recorded = generation.recorded_logprobs or []
                if len(recorded) > sent:
                    on_piece(LOGPROBS, recorded[sent:])
                    sent = len(recorded)
            if on_piece is not None:
                on_piece(channel, piece)
        recorded = generation.recorded_logprobs or []
        if on_piece is not None and len(recorded) > sent:  # tokens whose text never came (a cut character)
            on_piece(LOGPROBS, recorded[sent:])
    except BaseException:
        generation.interrupt()  # the cache must match what it says it holds, whatever went wrong
        raise
    result = generation.result
    served.metrics.generation(result.stats)
    if cancelled.is_set():
        served.metrics.cancelled.inc()
        return None
    if served.stopping.is_set():
        return None  # cut by a shutdown: the stream says so, a waiting request gets a 503
    text, reasoning, reasoning_tokens, calls = stream.summary(result)
    outcome = Outcome(
        text, result.finish_reason, result.stats, params.as_dict(), reasoning, reasoning_tokens, calls
    )
    outcome.logprobs, outcome.token_ids = result.logprobs, result.token_ids
    outcome.stop_sequence = result.stop_sequence
    if job.echo:
        outcome.prompt_ids, outcome.prompt_logprobs = job.ids, prompt_logprobs
    return outcome


async def _stream(
    served: Served, request: Request, jobs: list[Job], request_id: str, created: int, include_usage: bool
) -> AsyncIterator[str]:
    """Every choice at once (one after another where the server runs one generation at a
    time), each chunk naming its choice's index; each choice's last chunk as it ends."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[tuple[int, str, Any]] = asyncio.Queue()
    cancelled = threading.Event()
    chat = jobs[0].chat
    chunks = [
        functools.partial(_chunk, served.model_id, request_id, created, chat, index=index)
        for index in range(len(jobs))
    ]
    futures = []
    outcomes: dict[int, Outcome] = {}
    try:
        for index, job in enumerate(jobs):

            def on_piece(channel: str, piece: Any, index: int = index) -> None:
                loop.call_soon_threadsafe(queue.put_nowait, (index, channel, piece))

            future = loop.run_in_executor(
                served.generations, functools.partial(_generate, served, job, on_piece, cancelled)
            )
            future.add_done_callback(lambda _, index=index: queue.put_nowait((index, "done", "")))
            futures.append(future)
            if chat:
                yield _sse(chunks[index]({"role": "assistant", "content": ""}, None))
        while len(outcomes) < len(jobs):
            index, kind, piece = await queue.get()
            if kind != "done":
                yield _sse(_piece_chunk(served, jobs[index], chunks[index], kind, piece))
                continue
            try:
                outcome = futures[index].result()
            except Exception as error:  # the stream has begun: the error goes in it, as OpenAI does
                code = error.code if isinstance(error, RequestError) else None  # e.g. kv_memory_full
                yield _sse(error_body(_describe(error), "server_error", code=code))
                return
            if outcome is None:
                if served.stopping.is_set():  # an error event and no [DONE]: the client knows it was cut
                    yield _sse(error_body("the server is shutting down: this reply was cut", "server_error"))
                return
            outcomes[index] = outcome
            final = chunks[index]({} if chat else "", _finish_reason(outcome))
            final["choices"][0] |= _stop_reason(outcome)
            final["timings"], final["sampling"] = _timings(outcome), outcome.sampling
            yield _sse(final)
        finished = [outcomes[index] for index in range(len(jobs))]
        request.state.usage = _token_counts(finished)
        if include_usage:
            usage = _chunk(served.model_id, request_id, created, chat, {}, None)
            yield _sse(usage | {"choices": [], "usage": _usage(finished)})
        yield "data: [DONE]\n\n"
    finally:
        cancelled.set()  # a client that left, or a choice that failed: the others stop at their next token


def _piece_chunk(
    served: Served, job: Job, chunk: Callable[..., dict[str, Any]], kind: str, piece: Any
) -> dict[str, Any]:
    """One streamed piece as a chunk: text, thinking, a part of a call, or logprobs."""
    chat = job.chat
    if kind == TOOL_CALL:
        return chunk({"tool_calls": [_call_delta(piece)]}, None)
    if kind in (LOGPROBS, ECHO):  # the tokens of the text that follows, scored
        tokenizer = served.loaded.tokenizer
        ids = job.ids if kind == ECHO else [entry.token_id for entry in piece]
        if chat:
            scored = chunk({}, None)
            scored["choices"][0]["logprobs"] = chat_logprobs(tokenizer, piece)
        else:
            scored = chunk(tokenizer.decode(ids) if kind == ECHO else "", None)
            scored["choices"][0]["logprobs"] = completion_logprobs(tokenizer, ids, piece)
        return scored
    delta = {"reasoning_content" if kind == REASONING else "content": piece}
    return chunk(delta if chat else piece, None)


def _call_delta(part: CallStart | CallArguments) -> dict[str, Any]:
    """A streamed call, as OpenAI streams it: its id and name first, then its arguments in pieces."""
    if isinstance(part, CallStart):
        function = {"name": part.name, "arguments": ""}
        return {"index": part.index, "id": part.id, "type": "function", "function": function}
    return {"index": part.index, "function": {"arguments": part.text}}


def _chunk(
    model: str, request_id: str, created: int, chat: bool, delta: Any, finish: str | None, index: int = 0
) -> dict[str, Any]:
    choice: dict[str, Any] = {"index": index, "finish_reason": finish}
    if chat:
        choice["delta"] = delta
    else:
        choice["text"] = delta
    return {
        "id": request_id,
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": created,
        "model": model,
        "choices": [choice],
    }


def _completion(served: Served, request_id: str, created: int, outcomes: list[Outcome], chat: bool) -> Any:
    return {
        "id": request_id,
        "object": "chat.completion" if chat else "text_completion",
        "created": created,
        "model": served.model_id,
        "choices": [_choice(served, index, outcome, chat) for index, outcome in enumerate(outcomes)],
        "usage": _usage(outcomes),
        "timings": _timings(outcomes[0]),
        "sampling": outcomes[0].sampling,
    }


def _choice(served: Served, index: int, outcome: Outcome, chat: bool) -> dict[str, Any]:
    finish = _finish_reason(outcome)
    tokenizer = served.loaded.tokenizer
    if chat:
        calls = outcome.tool_calls
        message: dict[str, Any] = {"role": "assistant", "content": outcome.text or (None if calls else "")}
        if calls:
            message["tool_calls"] = [call.openai() for call in calls]
        if outcome.reasoning_tokens is not None:  # a model that thinks: its thinking, apart
            message["reasoning_content"] = outcome.reasoning
        choice = {"index": index, "message": message, "finish_reason": finish, "logprobs": None}
        choice |= _stop_reason(outcome)
        if outcome.logprobs is not None:
            choice["logprobs"] = chat_logprobs(tokenizer, outcome.logprobs)
        return choice
    prompt_text = tokenizer.decode(outcome.prompt_ids) if outcome.prompt_logprobs is not None else ""
    choice = {"index": index, "text": prompt_text + outcome.text, "finish_reason": finish, "logprobs": None}
    choice |= _stop_reason(outcome)
    if outcome.logprobs is not None or outcome.prompt_logprobs is not None:
        ids = outcome.prompt_ids + outcome.token_ids[: len(outcome.logprobs or [])]
        entries = [*(outcome.prompt_logprobs or []), *(outcome.logprobs or [])]
        choice["logprobs"] = completion_logprobs(tokenizer, ids, entries)
    return choice


def _finish_reason(outcome: Outcome) -> str:
    if outcome.finish_reason == "length":
        return "length"
    return "tool_calls" if outcome.tool_calls else "stop"


def _stop_reason(outcome: Outcome) -> dict[str, Any]:
    """The stop string that ended a choice, as vLLM names it (`stop_reason`): Anthropic's
    `stop_sequence` is read from it. Nothing when none did."""
    return {} if outcome.stop_sequence is None else {"stop_reason": outcome.stop_sequence}


def _usage(outcomes: list[Outcome]) -> dict[str, Any]:
    """The tokens of every choice: each prompt once per choice, as OpenAI counts n > 1."""
    prompt, completion = _token_counts(outcomes)
    usage: dict[str, Any] = {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": sum(outcome.stats.cached_tokens for outcome in outcomes)},
    }
    thought = [outcome.reasoning_tokens for outcome in outcomes if outcome.reasoning_tokens is not None]
    if thought:
        usage["completion_tokens_details"] = {"reasoning_tokens": sum(thought)}
    return usage


def _timings(outcome: Outcome) -> dict[str, Any]:
    stats = outcome.stats
    return {
        "ttft_s": round(stats.ttft_s, 6),
        "prefill_tok_s": round(stats.prefill_tok_s, 3),
        "decode_tok_s": round(stats.decode_tok_s, 3),
        "prefilled_tokens": stats.prefilled_tokens,
        "cached_tokens": stats.cached_tokens,
        "speculative": stats.speculative.as_dict() if stats.speculative else None,
    }


def _sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


def _describe(error: BaseException) -> str:
    if isinstance(error, LlmcliError):
        return error.one_line()
    if isinstance(error, RequestError):  # a stream's generation refused as it started
        return error.message
    return f"{type(error).__name__}: {error}"


def _error(
    path: str, status: int, message: str, param: str | None = None, code: str | None = None
) -> JSONResponse:
    return JSONResponse(error_for(path, status, message, param, code), status_code=status)


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, error: RequestValidationError) -> JSONResponse:
        problems = error.errors()
        first = problems[0] if problems else {}
        if first.get("type") == "json_invalid":
            return _answer(request, 400, "the request body is not valid JSON", code="invalid_json")
        where = ".".join(str(part) for part in first.get("loc", ())[1:]) or None
        if first.get("type") == "extra_forbidden":
            return _answer(request, 400, f"{where} is not supported here", where, "unknown_parameter")
        # 400, as OpenAI answers a bad value (FastAPI's own would be 422), naming the parameter.
        return _answer(
            request, 400, f"{where or 'body'}: {first.get('msg', 'invalid value')}", where, "invalid_value"
        )

    @app.exception_handler(RequestError)
    async def refused(request: Request, error: RequestError) -> JSONResponse:
        _release(request)
        response = _answer(request, error.status, error.message, error.param, error.code)
        response.headers.update(error.headers or {})
        return response

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, error: HTTPException) -> JSONResponse:
        if error.status_code == 404:
            return _answer(
                request, 404, f"no route {request.method} {request.url.path} here (see GET /v1/models)"
            )
        if error.status_code == 405:
            return _answer(request, 405, f"{request.url.path} does not take {request.method}")
        return _answer(request, error.status_code, str(error.detail))

    @app.exception_handler(LlmcliError)
    async def llmcli_error(request: Request, error: LlmcliError) -> JSONResponse:
        _release(request)
        return _answer(request, 400, error.one_line())

    @app.exception_handler(Exception)
    async def crashed(request: Request, error: Exception) -> JSONResponse:
        _release(request)
        return _answer(request, 500, _describe(error))


def _answer(
    request: Request, status: int, message: str, param: str | None = None, code: str | None = None
) -> JSONResponse:
    """An error in the shape of the protocol the request spoke (protocol.error_for)."""
    return _error(request.url.path, status, message, param, code)


def _release(request: Request) -> None:
    """A request that failed before its generation started gives its place in the queue back."""
    ticket = getattr(request.state, "ticket", None)
    if ticket is not None:
        ticket.release()


class BodyLimit:
    """413 for a body over `limit` bytes, by its Content-Length or, when chunked, as it arrives."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers", ())).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            await self._too_large(scope, receive, send)
            return
        seen, started, too_large = 0, False, False

        async def counting_receive() -> Any:
            nonlocal seen, too_large
            if too_large:
                return {"type": "http.disconnect"}
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.limit:  # the app stops reading here; its answer is replaced by a 413
                    too_large = True
                    return {"type": "http.disconnect"}
            return message

        async def tracking_send(message: Any) -> None:
            nonlocal started
            if too_large:
                return
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counting_receive, tracking_send)
        except Exception as error:  # answered already by the handlers: no traceback on stderr
            if not started and not too_large:
                await _error(scope["path"], 500, _describe(error))(scope, receive, send)
        if too_large and not started:
            await self._too_large(scope, receive, send)

    async def _too_large(self, scope: Scope, receive: Receive, send: Send) -> None:
        message = f"the request body is over {self.limit} bytes"
        await _error(scope["path"], 413, message)(scope, receive, send)
