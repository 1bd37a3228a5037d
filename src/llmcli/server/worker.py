"""The generations: each job run on a generation thread in its turn, on the engine that suits
its prompt, its pieces handed out as they come (`on_piece`) and its end as an Outcome."""

from __future__ import annotations

import asyncio
import functools
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from fastapi import Request

from llmcli.config.settings import SamplingParams, SamplingSettings
from llmcli.engine.reply import ReplyStream
from llmcli.server.logprobs import score_prompt
from llmcli.server.state import Served, Ticket

if TYPE_CHECKING:
    from llmcli.engine.structured import OutputFormat
    from llmcli.engine.tools import ToolCall
    from llmcli.engine.tools.turn import ToolTurn

LOGPROBS, ECHO = "logprobs", "echo"  # the stream's channels beside text and tool calls
DISCONNECT_POLL_S = 0.1  # how often a non-streaming request checks that its client is still there


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


def token_counts(outcomes: list[Outcome]) -> tuple[int, int]:
    return (
        sum(outcome.stats.prompt_tokens for outcome in outcomes),
        sum(outcome.stats.completion_tokens for outcome in outcomes),
    )


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
