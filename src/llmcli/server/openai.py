"""OpenAI's chat and text completions: the routes, and the answers in OpenAI's shape (a dict,
or a stream of server-sent chunks)."""

from __future__ import annotations

import functools
import json
import time
import uuid
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request

from llmcli.engine.reasoning import REASONING
from llmcli.engine.reply import TOOL_CALL
from llmcli.engine.tools.reader import CallArguments, CallStart
from llmcli.server.answers import chat_response, completion_response
from llmcli.server.events import (
    ECHO,
    LOGPROBS,
    Encoder,
    Ended,
    Failed,
    Outcome,
    Piece,
    Usage,
)
from llmcli.server.fleet import Fleet
from llmcli.server.logprobs import chat_logprobs, completion_logprobs
from llmcli.server.protocol import ChatRequest, CompletionRequest, error_body
from llmcli.server.state import Served
from llmcli.server.worker import Job


def install_openai(app: FastAPI, fleet: Fleet) -> None:
    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> dict[str, Any]:
        listed = {entry["name"]: entry for entry in fleet.listing()}
        if model_id not in listed:
            raise fleet.not_here(model_id)
        return _model_object(listed[model_id])

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [_model_object(entry) for entry in fleet.listing()]}

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatRequest, request: Request) -> Any:
        served = await fleet.serving(body.model)
        encoder_for = functools.partial(OpenAIEncoder, served, chat=True, include_usage=body.include_usage)
        return await chat_response(served, request, body, encoder_for)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Any:
        served = await fleet.serving(body.model)
        encoder_for = functools.partial(OpenAIEncoder, served, chat=False, include_usage=body.include_usage)
        return await completion_response(served, request, body, encoder_for)


def _model_object(entry: dict[str, Any]) -> dict[str, Any]:
    """A model as OpenAI lists one, with what llmcli knows of its state beside (loaded, loading,
    available: listed, not held; its idle time and weights' size once loaded)."""
    state = {key: entry[key] for key in ("state", "idle_s", "weight_bytes") if key in entry}
    return {"id": entry["name"], "object": "model", "created": 0, "owned_by": "llmcli", **state}


class OpenAIEncoder(Encoder):
    """OpenAI's chat and completion chunks: a role chunk per choice as it is submitted (chat),
    each piece its own chunk naming its choice, each choice's final chunk as it ends, the usage
    chunk when asked, and `[DONE]`."""

    def __init__(self, served: Served, jobs: list[Job], *, chat: bool, include_usage: bool = False) -> None:
        self.served, self.jobs, self.chat, self.include_usage = served, jobs, chat, include_usage
        self.headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}  # no proxy holds chunks back
        self.request_id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())
        self.chunks = [
            functools.partial(_chunk, served.model_id, self.request_id, self.created, chat, index=index)
            for index in range(len(jobs))
        ]

    def opened(self, choice: int) -> str:
        return _sse(self.chunks[choice]({"role": "assistant", "content": ""}, None)) if self.chat else ""

    def piece(self, piece: Piece) -> str:
        choice = piece.choice
        return _sse(
            _piece_chunk(self.served, self.jobs[choice], self.chunks[choice], piece.channel, piece.value)
        )

    def ended(self, ended: Ended) -> str:
        outcome = ended.outcome
        final = self.chunks[ended.choice]({} if self.chat else "", outcome.finish)
        final["choices"][0] |= _stop_reason(outcome)
        final["timings"], final["sampling"] = _timings(outcome), outcome.sampling
        return _sse(final)

    def closing(self, outcomes: list[Outcome]) -> str:
        done = "data: [DONE]\n\n"
        if not self.include_usage:
            return done
        usage = _chunk(self.served.model_id, self.request_id, self.created, self.chat, {}, None)
        return _sse(usage | {"choices": [], "usage": _usage(outcomes)}) + done

    def failed(self, failed: Failed) -> str:  # an error object and no [DONE]: the client knows it was cut
        return _sse(error_body(failed.message, "server_error", code=failed.code))

    def whole(self, outcomes: list[Outcome]) -> dict[str, Any]:
        return _completion(self.served, self.request_id, self.created, outcomes, self.chat)

    def scores(
        self, prompts: list[list[int]], scored: list[list[Any]], with_logprobs: bool
    ) -> dict[str, Any]:
        tokenizer = self.served.loaded.tokenizer
        choices = []
        for index, (ids, entries) in enumerate(zip(prompts, scored, strict=True)):
            logprobs = completion_logprobs(tokenizer, ids, entries) if with_logprobs else None
            choices.append(
                {
                    "index": index,
                    "text": tokenizer.decode(ids),
                    "finish_reason": "length",
                    "logprobs": logprobs,
                }
            )
        total = sum(len(ids) for ids in prompts)
        return {
            "id": "cmpl-" + uuid.uuid4().hex[:24],
            "object": "text_completion",
            "created": int(time.time()),
            "model": self.served.model_id,
            "choices": choices,
            "usage": {"prompt_tokens": total, "completion_tokens": 0, "total_tokens": total},
        }


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
    finish = outcome.finish
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


def _stop_reason(outcome: Outcome) -> dict[str, Any]:
    """The stop string that ended a choice, as vLLM names it (`stop_reason`); nothing when none did."""
    return {} if outcome.stop_sequence is None else {"stop_reason": outcome.stop_sequence}


def _usage(outcomes: list[Outcome]) -> dict[str, Any]:
    """The tokens of every choice: each prompt once per choice, as OpenAI counts n > 1."""
    counted = Usage.of(outcomes)
    usage: dict[str, Any] = {
        "prompt_tokens": counted.prompt,
        "completion_tokens": counted.completion,
        "total_tokens": counted.prompt + counted.completion,
        "prompt_tokens_details": {"cached_tokens": counted.cached},
    }
    if counted.reasoning is not None:
        usage["completion_tokens_details"] = {"reasoning_tokens": counted.reasoning}
    return usage


def _timings(outcome: Outcome) -> dict[str, Any]:
    stats = outcome.stats
    return {
        "ttft_s": round(stats.ttft_s, 6),
        "prefill_tok_s": round(stats.prefill_tok_s, 3),
        "decode_tok_s": round(stats.decode_tok_s, 3),
        "prefilled_tokens": stats.prefilled_tokens,
        "cached_tokens": stats.cached_tokens,
        "cached_from": stats.cached_from,  # memory, slot or disk: where they came from
        "speculative": stats.speculative.as_dict() if stats.speculative else None,
    }


def _sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"
