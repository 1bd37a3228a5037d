"""The generations: each job run on a generation thread in its turn, on the engine that suits
its prompt, its pieces handed out as they come and its end as an Outcome (events.py). A stream
gives every event of a request's choices to the encoder of the protocol it spoke; nothing here
knows a protocol's shape."""

from __future__ import annotations

import asyncio
import functools
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from fastapi import Request

from llmcli.config.settings import SamplingParams, SamplingSettings
from llmcli.engine.reply import ReplyStream
from llmcli.server.events import ECHO, LOGPROBS, Encoder, Ended, Failed, Outcome, Piece, Usage
from llmcli.server.logprobs import score_prompt
from llmcli.server.state import RequestError, Served, Ticket, describe

if TYPE_CHECKING:
    from llmcli.engine.structured import OutputFormat
    from llmcli.engine.tools.turn import ToolTurn

DISCONNECT_POLL_S = 0.1  # how often a non-streaming request checks that its client is still there


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
    cache_key: str | None = None  # the client's prompt_cache_key: a hint for the slot it runs on
    # Another choice of the same prompt, set once its prompt is in its cache: this one starts
    # then, to copy that prompt from it rather than prefill it again (scheduler.Slots).
    after: threading.Event | None = None
    prompt_cached: threading.Event = field(default_factory=threading.Event)


async def run_while_connected(served: Served, request: Request, job: Job) -> Outcome | None:
    """A non-streaming generation; a client that leaves stops it at the next token (or before
    it starts)."""
    cancelled = threading.Event()
    work = functools.partial(generate, served, job, None, cancelled)
    future = asyncio.get_running_loop().run_in_executor(served.generations, work)
    while not (await asyncio.wait({future}, timeout=DISCONNECT_POLL_S))[0]:
        if await request.is_disconnected():
            cancelled.set()
    return await future


def generate(
    served: Served, job: Job, on_piece: Callable[[str, Any], None] | None, cancelled: threading.Event
) -> Outcome | None:
    """On a generation thread, in its turn: one generation, start to end (None when its
    client left first). `on_piece` gets (channel, piece): reasoning or content text, or a part
    of a tool call."""
    if job.after is not None:
        job.after.wait()
    params = job.sampling.resolve(served.loaded.generation_config).with_(logit_bias=job.logit_bias)
    try:
        longest = len(job.ids) + params.max_new_tokens
        with served.turn_on_an_engine(job.ids, longest, job.cache_key) as engine:
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


async def stream(served: Served, request: Request, jobs: list[Job], encoder: Encoder) -> AsyncIterator[str]:
    """Every choice at once (one after another where the server runs one generation at a
    time), each event as it comes, in the encoder's words; each choice's end as it ends."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[Piece | int] = asyncio.Queue()  # a piece, or the index of a choice that ended
    cancelled = threading.Event()
    futures = []
    outcomes: dict[int, Outcome] = {}
    try:
        opening = encoder.opening()
        if opening:
            yield opening
        for index, job in enumerate(jobs):

            def on_piece(channel: str, value: Any, index: int = index) -> None:
                loop.call_soon_threadsafe(queue.put_nowait, Piece(index, channel, value))

            future = loop.run_in_executor(
                served.generations, functools.partial(generate, served, job, on_piece, cancelled)
            )
            future.add_done_callback(lambda _, index=index: queue.put_nowait(index))
            futures.append(future)
            opened = encoder.opened(index)
            if opened:
                yield opened
        while len(outcomes) < len(jobs):
            event = await queue.get()
            if type(event) is Piece:
                text = encoder.piece(event)
                if text:
                    yield text
                continue
            try:
                outcome = futures[event].result()
            except Exception as error:  # the stream has begun: the error goes in it
                code = error.code if isinstance(error, RequestError) else None  # e.g. kv_memory_full
                yield encoder.failed(Failed(describe(error), code))
                return
            if outcome is None:
                if served.stopping.is_set():  # an error and no proper end: the client knows it was cut
                    yield encoder.failed(Failed("the server is shutting down: this reply was cut"))
                return
            outcomes[event] = outcome
            ended = encoder.ended(Ended(event, outcome))
            if ended:
                yield ended
        finished = [outcomes[index] for index in range(len(jobs))]
        request.state.usage = Usage.of(finished).counts
        yield encoder.closing(finished)
    finally:
        cancelled.set()  # a client that left, or a choice that failed: the others stop at their next token
