"""A request answered, in whichever protocol it spoke: admitted to the queue, its prompts made and
its values checked (prompts.py), its choices generated (worker.py) and their events given to the
protocol's encoder (events.Encoder), streamed or whole. Every route's generation comes here: the
protocols differ only in how they read a request and how they encode the events."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from llmcli.server.events import Encoder, Usage
from llmcli.server.logprobs import score_prompt
from llmcli.server.prompts import chat_prompt, completion_prompts, jobs_for
from llmcli.server.protocol import ChatRequest, CompletionRequest, _Sampling
from llmcli.server.state import RequestError, Served, Ticket
from llmcli.server.worker import Job, run_while_connected, stream

if TYPE_CHECKING:
    from llmcli.engine.tools.turn import ToolTurn

EncoderFor = Callable[[list[Job]], Encoder]  # a request's encoder, made once its choices are known


async def chat_response(
    served: Served,
    request: Request,
    body: ChatRequest,
    encoder_for: EncoderFor,
    *,
    continue_final: bool = False,
    to_context_end: bool = False,
) -> Any:
    """A chat request answered by `encoder_for`'s encoder. `continue_final`: the last message
    is the assistant's, for the reply to continue (Anthropic's prefill)."""
    request.state.ticket = ticket = served.admit()  # given back by the worker or the error handler
    ids, turn = await chat_prompt(served, body, continue_final)
    return await respond(
        served,
        request,
        body,
        [ids],
        ticket,
        encoder_for,
        chat=True,
        tools=turn,
        to_context_end=to_context_end,
    )


async def completion_response(
    served: Served,
    request: Request,
    body: CompletionRequest,
    encoder_for: EncoderFor,
    *,
    to_context_end: bool = False,
) -> Any:
    """A text completion answered by `encoder_for`'s encoder."""
    ticket = request.state.ticket = served.admit()
    prompts = await completion_prompts(served, body)
    if body.scores_only:
        scored = await _scores_only(served, body, prompts, ticket)
        return encoder_for([]).scores(prompts, scored, body.logprobs is not None)
    return await respond(
        served, request, body, prompts, ticket, encoder_for, chat=False, to_context_end=to_context_end
    )


async def respond(
    served: Served,
    request: Request,
    body: _Sampling,
    prompts: list[list[int]],
    ticket: Ticket,
    encoder_for: EncoderFor,
    *,
    chat: bool,
    tools: ToolTurn | None = None,
    to_context_end: bool = False,
) -> Any:
    """One choice per prompt and per `n`: generated together where the server runs several
    generations at once, streamed or not."""
    jobs = jobs_for(served, body, prompts, ticket, chat=chat, tools=tools, to_context_end=to_context_end)
    encoder = encoder_for(jobs)
    if body.stream:
        events = stream(served, request, jobs, encoder)
        return StreamingResponse(events, media_type=encoder.media_type, headers=encoder.headers)
    # Every choice at once: with --parallel above 1 their decode steps run together.
    finished = await asyncio.gather(*(run_while_connected(served, request, job) for job in jobs))
    if None in finished and served.stopping.is_set():
        raise RequestError(503, "the server is shutting down: this reply was cut", code="shutting_down")
    if None in finished:  # nobody is there to read an answer
        return Response(status_code=499)
    outcomes = [outcome for outcome in finished if outcome is not None]
    request.state.usage = Usage.of(outcomes).counts
    return encoder.whole(outcomes)


async def _scores_only(
    served: Served, body: CompletionRequest, prompts: list[list[int]], ticket: Ticket
) -> list[list[Any]]:
    """max_tokens 0 with echo: each prompt's tokens scored, nothing generated (how lm-eval asks
    for a loglikelihood)."""
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

    return await asyncio.get_running_loop().run_in_executor(served.generations, score)
