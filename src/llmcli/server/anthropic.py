"""Anthropic's Messages API over the same model and worker: translation only.

`POST /v1/messages` becomes an OpenAI chat request answered by the same code as
`/v1/chat/completions`, and the answer is translated back: a message with content blocks
(thinking, text, tool_use), or Anthropic's event stream (`message_start`, `content_block_start`,
`content_block_delta` with `text_delta` / `thinking_delta` / `input_json_delta`,
`content_block_stop`, `message_delta` with the stop reason and usage, `message_stop`).
`POST /v1/messages/count_tokens` renders the prompt and counts it. A final assistant message
is a prefill: the reply continues its text. Errors come in Anthropic's shape. Image and
document blocks are refused (a text model); earlier `thinking` blocks are not shown to the
model again (as Anthropic's API drops them from earlier turns).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any, Literal

from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse
from pydantic import Field, model_validator

from llmcli.errors import LlmcliError
from llmcli.server import openai
from llmcli.server.answers import chat_response
from llmcli.server.prompts import chat_prompt
from llmcli.server.translate import Body, Part, chunk_of, events_of, read_body, validated

if TYPE_CHECKING:
    from llmcli.server.state import Served

STOP_REASONS = {"length": "max_tokens", "tool_calls": "tool_use", "stop": "end_turn"}
CHOICES = {"auto": "auto", "any": "required", "none": "none"}


class AnthropicError(LlmcliError):
    """A request the Messages API cannot take here: a 400 in Anthropic's error shape."""


class Block(Part):
    """A content block: text, tool_use, tool_result (its content text or blocks), thinking; the
    adapter refuses the other kinds (image, document)."""

    type: str
    text: str | None = None
    id: str | None = None
    name: str | None = None
    input: dict[str, Any] | None = None
    tool_use_id: str | None = None
    content: str | list[Block] | None = None


class Message(Body):
    role: Literal["user", "assistant"]
    content: str | list[Block]


class Tool(Body):
    type: Literal["custom"] | None = None  # Anthropic's server tools (web search, …) are not run here
    name: str
    description: str | None = None
    input_schema: dict[str, Any]
    cache_control: dict[str, Any] | None = None


class ToolChoice(Body):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class Thinking(Body):
    type: Literal["enabled", "disabled"]
    budget_tokens: int | None = Field(default=None, ge=1)

    @model_validator(mode="after")
    def _budget_when_enabled(self) -> Thinking:
        if self.type == "disabled" and self.budget_tokens is not None:
            raise ValueError("budget_tokens is for thinking enabled: thinking disabled has no budget")
        return self


class MessagesRequest(Body):
    """The fields taken; metadata, service_tier and cache_control change nothing here (the KV
    cache is reused by prefix on its own). Any other field is refused, never ignored."""

    model: str | None = None
    max_tokens: int
    messages: list[Message]
    system: str | list[Block] | None = None
    stream: bool | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stop_sequences: list[str] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    metadata: dict[str, Any] | None = None
    service_tier: str | None = None
    cache_control: dict[str, Any] | None = None


class CountRequest(MessagesRequest):
    max_tokens: int = 1  # a count generates nothing


def install_anthropic(app: FastAPI, served: Served) -> None:
    @app.post("/v1/messages")
    async def messages(request: Request) -> Any:
        body = await read_body(request, MessagesRequest, AnthropicError)
        asked, prefill = _chat_request(body)
        prompt_tokens = 0

        def encoder_for(jobs: list[Any]) -> Any:
            nonlocal prompt_tokens
            prompt_tokens = len(jobs[0].ids)
            return openai.OpenAIEncoder(served, jobs, chat=True, include_usage=True)

        answered = await chat_response(served, request, asked, encoder_for, continue_final=prefill)
        model = served.model_id  # the model that answered, as the OpenAI route names it
        if isinstance(answered, StreamingResponse):
            events = _events(events_of(answered.body_iterator), model, prompt_tokens)
            return StreamingResponse(events, media_type="text/event-stream")
        return _message(answered, model)

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(request: Request) -> dict[str, Any]:
        body = await read_body(request, CountRequest, AnthropicError)
        asked, prefill = _chat_request(body | {"max_tokens": 1})
        ids, _ = await chat_prompt(served, asked, prefill)
        return {"input_tokens": len(ids)}


def _chat_request(body: dict[str, Any]) -> tuple[Any, bool]:
    """The Messages request as an OpenAI chat request (validated: a bad value is a 400), and
    whether its final assistant message is a prefill for the reply to continue."""
    from llmcli.server.protocol import ChatRequest

    messages = _system(body.get("system"))
    for position, message in enumerate(body.get("messages") or []):
        messages += _turn(message, f"messages.{position}")
    prefill = _prefill(messages)
    asked: dict[str, Any] = {
        "messages": messages,
        "max_tokens": body["max_tokens"],
        "stream": bool(body.get("stream")),
        "stream_options": {"include_usage": True},
    }
    for name, openai_name in (("temperature", "temperature"), ("top_p", "top_p"), ("top_k", "top_k")):
        if body.get(name) is not None:
            asked[openai_name] = body[name]
    if body.get("stop_sequences"):
        asked["stop"] = body["stop_sequences"]
    if body.get("tools"):
        asked["tools"] = [_tool(tool) for tool in body["tools"]]
    choice = body.get("tool_choice")
    if isinstance(choice, dict):
        kind = choice.get("type")
        asked["tool_choice"] = (
            {"type": "function", "function": {"name": choice.get("name")}}
            if kind == "tool"
            else CHOICES.get(kind)
        )
        if asked["tool_choice"] is None:
            raise AnthropicError(f"tool_choice type {kind!r} is auto, any, tool or none")
        if choice.get("disable_parallel_tool_use"):
            asked["parallel_tool_calls"] = False
    thinking = body.get("thinking")
    if isinstance(thinking, dict):
        if thinking.get("type") == "disabled":
            asked["chat_template_kwargs"] = {"enable_thinking": False}
        elif thinking.get("type") == "enabled" and thinking.get("budget_tokens") is not None:
            asked["think_budget"] = thinking["budget_tokens"]
    return validated(ChatRequest, asked, AnthropicError), prefill


def _prefill(messages: list[dict[str, Any]]) -> bool:
    """Whether the last message is the assistant's text for the reply to continue. An empty one
    only asks for the reply (it is dropped); trailing blanks are refused, as Anthropic refuses
    them (a template may trim them, and the reply would not continue the text sent)."""
    last = messages[-1] if messages else {}
    if last.get("role") != "assistant" or last.get("tool_calls"):
        return False
    if not last["content"]:
        messages.pop()
        return False
    if last["content"] != last["content"].rstrip():
        raise AnthropicError("messages: the final assistant content cannot end with trailing whitespace")
    return True


def _system(system: Any) -> list[dict[str, Any]]:
    if not system:
        return []
    if isinstance(system, list):
        system = "".join(_text_of(block, "system") for block in system)
    return [{"role": "system", "content": system}]


def _turn(message: Any, where: str) -> list[dict[str, Any]]:
    """One Messages turn as OpenAI messages: a user's tool_result blocks become tool messages,
    an assistant's tool_use blocks its tool_calls."""
    if not isinstance(message, dict) or message.get("role") not in ("user", "assistant"):
        raise AnthropicError(f"{where}: a message has the role user or assistant")
    role, content = message["role"], message.get("content")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    text, calls, results = "", [], []
    for block in content or []:
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text":
            text += block.get("text") or ""
        elif kind == "tool_use":
            arguments = json.dumps(block.get("input") or {})
            calls.append(
                {"id": block.get("id"), "function": {"name": block.get("name"), "arguments": arguments}}
            )
        elif kind == "tool_result":
            result = block.get("content")
            result = result if isinstance(result, str) else "".join(_text_of(b, where) for b in result or [])
            results.append({"role": "tool", "tool_call_id": block.get("tool_use_id"), "content": result})
        elif kind in ("thinking", "redacted_thinking"):
            continue  # earlier thinking is not shown to the model again
        else:
            raise AnthropicError(f"{where}: {kind} blocks are not supported here (a text model)")
    shaped: list[dict[str, Any]] = [*results]
    if text or calls or not results:
        turn: dict[str, Any] = {"role": role, "content": text}
        if calls:
            turn["tool_calls"] = calls
        shaped.append(turn)
    return shaped


def _text_of(block: Any, where: str) -> str:
    if not isinstance(block, dict) or block.get("type") != "text":
        raise AnthropicError(f"{where}: only text blocks are supported here")
    return block.get("text") or ""


def _tool(tool: Any) -> dict[str, Any]:
    if not isinstance(tool, dict) or "name" not in tool:
        raise AnthropicError("tools: a tool has a name and an input_schema")
    function = {
        "name": tool["name"],
        "description": tool.get("description", ""),
        "parameters": tool.get("input_schema"),
    }
    return {"type": "function", "function": function}


def _message(answer: dict[str, Any], model: str) -> dict[str, Any]:
    choice = answer["choices"][0]
    message = choice["message"]
    content: list[dict[str, Any]] = []
    if message.get("reasoning_content"):
        content.append({"type": "thinking", "thinking": message["reasoning_content"], "signature": ""})
    if message.get("content"):
        content.append({"type": "text", "text": message["content"]})
    for call in message.get("tool_calls") or []:
        function = call["function"]
        content.append(
            {
                "type": "tool_use",
                "id": call["id"],
                "name": function["name"],
                "input": json.loads(function["arguments"]),
            }
        )
    usage = answer.get("usage") or {}
    return {
        "id": "msg_" + uuid.uuid4().hex[:24],
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        **_stop(choice["finish_reason"], choice.get("stop_reason")),
        "usage": _usage(usage),
    }


def _stop(finish: str, stop_sequence: str | None) -> dict[str, Any]:
    """Why the reply ended, Anthropic's way: a stop sequence is named."""
    if stop_sequence is not None:
        return {"stop_reason": "stop_sequence", "stop_sequence": stop_sequence}
    return {"stop_reason": STOP_REASONS.get(finish, "end_turn"), "stop_sequence": None}


def _usage(usage: dict[str, Any]) -> dict[str, Any]:
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {
        "input_tokens": usage.get("prompt_tokens", 0),
        "output_tokens": usage.get("completion_tokens", 0),
        "cache_read_input_tokens": cached,
    }


def _event(kind: str, data: dict[str, Any]) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data})}\n\n"


async def _events(chunks: AsyncIterator[Any], model: str, prompt_tokens: int) -> AsyncIterator[str]:
    """OpenAI's server-sent chunks as Anthropic's event stream: a block per kind of content,
    opened when its first piece comes and closed when another kind starts."""
    start = {"id": "msg_" + uuid.uuid4().hex[:24], "type": "message", "role": "assistant", "model": model}
    usage = _usage({"prompt_tokens": prompt_tokens})
    start |= {"content": [], "stop_reason": None, "stop_sequence": None, "usage": usage}
    yield _event("message_start", {"message": start})
    index, open_kind, finish, stop_sequence = -1, None, "stop", None
    async for raw in chunks:
        chunk = chunk_of(raw)
        if chunk is None:
            continue
        if "error" in chunk:  # a cut reply: Anthropic's error event, and no message_stop
            yield _event("error", {"error": {"type": "api_error", "message": chunk["error"]["message"]}})
            return
        for choice in chunk.get("choices") or ():
            finish = choice.get("finish_reason") or finish
            stop_sequence = choice.get("stop_reason") or stop_sequence
            delta = choice.get("delta") or {}
            pieces = []
            if delta.get("reasoning_content"):
                pieces.append(
                    ("thinking", None, {"type": "thinking_delta", "thinking": delta["reasoning_content"]})
                )
            if delta.get("content"):
                pieces.append(("text", None, {"type": "text_delta", "text": delta["content"]}))
            for part in delta.get("tool_calls") or ():
                if part.get("id"):  # a new call: its own block
                    block = {
                        "type": "tool_use",
                        "id": part["id"],
                        "name": part["function"]["name"],
                        "input": {},
                    }
                    pieces.append(("tool_use", block, None))
                arguments = (part.get("function") or {}).get("arguments")
                if arguments:
                    pieces.append(("tool_use", None, {"type": "input_json_delta", "partial_json": arguments}))
            for kind, new_block, piece in pieces:
                if new_block is not None or kind != open_kind:
                    if open_kind is not None:
                        yield _event("content_block_stop", {"index": index})
                    index, open_kind = index + 1, kind
                    block = new_block or (
                        {"type": "text", "text": ""}
                        if kind == "text"
                        else {"type": "thinking", "thinking": "", "signature": ""}
                    )
                    yield _event("content_block_start", {"index": index, "content_block": block})
                if piece is not None:
                    yield _event("content_block_delta", {"index": index, "delta": piece})
        if chunk.get("usage"):
            if open_kind is not None:
                yield _event("content_block_stop", {"index": index})
            reason = _stop(finish, stop_sequence)
            yield _event("message_delta", {"delta": reason, "usage": _usage(chunk["usage"])})
            yield _event("message_stop", {})
