"""OpenAI's chat and text completions: the routes, and the answers in OpenAI's shape (a dict,
or a stream of server-sent chunks)."""

from __future__ import annotations

import asyncio
import functools
import json
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse

from llmcli.engine.reasoning import REASONING, thinking_of
from llmcli.engine.reply import TOOL_CALL
from llmcli.engine.tools.reader import CallArguments, CallStart
from llmcli.errors import LlmcliError
from llmcli.server.logprobs import chat_logprobs, completion_logprobs, score_prompt
from llmcli.server.prompts import (
    chat_prompt,
    check_fits,
    checked_sampling,
    completion_prompts,
    logprobs_asked,
    sample,
)
from llmcli.server.protocol import ChatRequest, CompletionRequest, _Sampling, error_body
from llmcli.server.state import RequestError, Served, Ticket, describe
from llmcli.server.worker import ECHO, LOGPROBS, Job, Outcome, generate, run_while_connected, token_counts

if TYPE_CHECKING:
    from llmcli.engine.tools.turn import ToolTurn


def install_openai(app: FastAPI, served: Served) -> None:
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


async def completion_response(served: Served, request: Request, body: CompletionRequest) -> Any:
    """A text completion answered, in OpenAI's shape."""
    ticket = request.state.ticket = served.admit()
    prompts = await completion_prompts(served, body)
    if body.scores_only:
        return await _scores_only(served, body, prompts, ticket)
    return await _respond(served, request, body, prompts, ticket, chat=False)


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
    sampling = checked_sampling(body)
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
        check_fits(served, ids, sampling, chat)
    try:
        bias = body.bias(served.loaded.vocab_size)
    except LlmcliError as error:
        raise RequestError(400, error.message, "logit_bias") from None
    logprobs, echo = logprobs_asked(body, method)
    budget = getattr(body, "think_budget", None)
    if budget is not None and thinking_of(served.loaded.tokenizer) is None:
        message = "a thinking budget needs a model that thinks, and this model's template marks none"
        raise RequestError(400, message, "think_budget")
    jobs = [
        Job(ids, sample(sampling, k), method, output, chat, ticket, tools, bias, logprobs, echo, budget)
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
    finished = await asyncio.gather(*(run_while_connected(served, request, job) for job in jobs))
    if None in finished and served.stopping.is_set():
        raise RequestError(503, "the server is shutting down: this reply was cut", code="shutting_down")
    if None in finished:  # nobody is there to read an answer
        return Response(status_code=499)
    outcomes = [outcome for outcome in finished if outcome is not None]
    request.state.usage = token_counts(outcomes)
    return _completion(served, request_id, created, outcomes, chat)


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
                served.generations, functools.partial(generate, served, job, on_piece, cancelled)
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
                yield _sse(error_body(describe(error), "server_error", code=code))
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
        request.state.usage = token_counts(finished)
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
    prompt, completion = token_counts(outcomes)
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
