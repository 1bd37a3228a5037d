"""OpenAI's Responses API over the same model and worker: translation only.

`POST /v1/responses` becomes a chat request answered by the same code as `/v1/chat/completions`
and comes back as a response object: output items (a `reasoning` item whose summary is the
thinking, a `message` with `output_text`, `function_call`s), or the Responses event stream
(`response.created`, `response.output_item.added`, `response.output_text.delta`,
`response.function_call_arguments.delta`, …, `response.completed`). Responses are kept in memory
(the newest 256, unless `store: false`), so `previous_response_id` continues a conversation; the
KV cache reuses its prefix as for any re-sent chat. Fields that are not honoured (non-function
tools, image and file inputs, `include`, `truncation: auto`) are refused.
"""

from __future__ import annotations

import json
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any, Literal

from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse
from pydantic import Field

from llmcli.errors import LlmcliError
from llmcli.server import openai
from llmcli.server.answers import chat_response
from llmcli.server.state import RequestError
from llmcli.server.translate import Body, Part, chunk_of, events_of, read_body, validated

if TYPE_CHECKING:
    from llmcli.server.state import Served

KEPT = 256  # stored responses, newest first out of the door last


class ResponsesError(LlmcliError):
    """A request the Responses API cannot take here: a 400."""


class ContentPart(Part):
    type: str  # input_text, output_text (or text) are read; the others (images, files) refused
    text: str | None = None


class Item(Part):
    """An input item: a message, a function_call, a function_call_output or earlier reasoning;
    the adapter refuses the other kinds."""

    type: str | None = None  # a message when absent
    role: str | None = None
    content: str | list[ContentPart] | None = None
    call_id: str | None = None
    name: str | None = None
    arguments: str | None = None
    output: str | None = None


class Format(Body):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | bool | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextOptions(Body):
    format: Format | None = None


class Reasoning(Body):
    effort: str | None = None
    summary: str | None = None


class Tool(Part):
    type: str  # function tools only: the adapter refuses the others
    name: str | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedTool(Body):
    type: Literal["function"]
    name: str


class ResponsesRequest(Body):
    """The fields taken; metadata, user, service_tier and prompt_cache_key change nothing here.
    Any other field is refused, never ignored."""

    model: str | None = None
    input: str | list[Item] | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    text: TextOptions | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["auto", "none", "required"] | NamedTool | None = None
    parallel_tool_calls: bool | None = None
    reasoning: Reasoning | None = None
    stream: bool | None = None
    previous_response_id: str | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    truncation: Literal["auto", "disabled"] | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None


class Stored(OrderedDict[str, list[dict[str, Any]]]):
    """Each stored response's whole conversation, as chat messages; the oldest leave first."""

    def keep(self, response_id: str, messages: list[dict[str, Any]]) -> None:
        self[response_id] = messages
        while len(self) > KEPT:
            self.popitem(last=False)


def install_responses(app: FastAPI, served: Served) -> None:
    stored = Stored()

    @app.post("/v1/responses")
    async def responses(request: Request) -> Any:
        body = _checked(await read_body(request, ResponsesRequest, ResponsesError))
        history = _history(stored, body.get("previous_response_id"))
        messages = history + _input(body)
        asked = _chat_request(body, messages)
        answered = await chat_response(served, request, asked, openai.chat_encoder(served, True))
        shell = _shell(body, served.model_id)
        keep = body.get("store", True) is not False
        if isinstance(answered, StreamingResponse):
            return StreamingResponse(
                _events(events_of(answered.body_iterator), shell, messages, stored if keep else None),
                media_type="text/event-stream",
            )
        response = _complete(shell, answered)
        if keep:
            stored.keep(response["id"], messages + _said(response["output"]))
        return response


def _checked(body: dict[str, Any]) -> dict[str, Any]:
    if body.get("truncation") not in (None, "disabled"):
        raise ResponsesError("truncation auto is not supported: a request over the context is refused")
    return body


def _history(stored: Stored, previous: Any) -> list[dict[str, Any]]:
    if previous is None:
        return []
    if previous not in stored:
        raise RequestError(
            404, f"no stored response {previous!r} (kept: the newest {KEPT})", "previous_response_id"
        )
    return [dict(message) for message in stored[previous]]


def _input(body: dict[str, Any]) -> list[dict[str, Any]]:
    """`instructions` and `input` (text, or items) as chat messages."""
    messages: list[dict[str, Any]] = []
    if body.get("instructions"):
        messages.append({"role": "system", "content": body["instructions"]})
    items = body.get("input")
    if isinstance(items, str):
        return [*messages, {"role": "user", "content": items}]
    for position, item in enumerate(items or []):
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind == "message":
            messages.append({"role": item.get("role"), "content": _text(item.get("content"), position)})
        elif kind == "function_call":
            call = {
                "id": item.get("call_id"),
                "function": {"name": item.get("name"), "arguments": item.get("arguments")},
            }
            if messages and messages[-1]["role"] == "assistant" and messages[-1].get("tool_calls"):
                messages[-1]["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            messages.append(
                {"role": "tool", "tool_call_id": item.get("call_id"), "content": item.get("output") or ""}
            )
        elif kind == "reasoning":
            continue  # earlier thinking is not shown to the model again
        else:
            raise ResponsesError(f"input[{position}]: {kind} items are not supported here")
    return messages


def _text(content: Any, position: int) -> str:
    if isinstance(content, str):
        return content
    text = ""
    for part in content or []:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text", "text"):
            raise ResponsesError(f"input[{position}]: {kind} parts are not supported here (a text model)")
        text += part.get("text") or ""
    return text


def _chat_request(body: dict[str, Any], messages: list[dict[str, Any]]) -> Any:
    from llmcli.server.protocol import ChatRequest

    asked: dict[str, Any] = {"messages": messages, "stream": bool(body.get("stream"))}
    asked["stream_options"] = {"include_usage": True}
    for name, chat_name in (
        ("max_output_tokens", "max_tokens"),
        ("temperature", "temperature"),
        ("top_p", "top_p"),
    ):
        if body.get(name) is not None:
            asked[chat_name] = body[name]
    form = ((body.get("text") or {}).get("format") or {}) if isinstance(body.get("text"), dict) else {}
    if form.get("type") == "json_object":
        asked["response_format"] = {"type": "json_object"}
    elif form.get("type") == "json_schema":
        schema = {"name": form.get("name") or "format", "schema": form.get("schema", True)}
        asked["response_format"] = {"type": "json_schema", "json_schema": schema}
    tools = []
    for tool in body.get("tools") or []:
        if not isinstance(tool, dict) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else tool
            raise ResponsesError(f"tools: {kind} tools are not supported here (function tools are)")
        function = {
            "name": tool.get("name"),
            "description": tool.get("description", ""),
            "parameters": tool.get("parameters"),
        }
        tools.append({"type": "function", "function": function})
    if tools:
        asked["tools"] = tools
    choice = body.get("tool_choice")
    if isinstance(choice, dict):
        choice = {"type": "function", "function": {"name": choice.get("name")}}
    if choice is not None:
        asked["tool_choice"] = choice
    if body.get("parallel_tool_calls") is not None:
        asked["parallel_tool_calls"] = body["parallel_tool_calls"]
    effort = (body.get("reasoning") or {}).get("effort")
    if effort:
        asked["reasoning_effort"] = effort
    return validated(ChatRequest, asked, ResponsesError)


def _shell(body: dict[str, Any], model: str) -> dict[str, Any]:
    """The response object before its output: what the request asked for, echoed."""
    return {
        "id": "resp_" + uuid.uuid4().hex[:24],
        "object": "response",
        "created_at": int(time.time()),
        "status": "in_progress",
        "model": model,  # the model that answers, as the OpenAI route names it
        "output": [],
        "instructions": body.get("instructions"),
        "max_output_tokens": body.get("max_output_tokens"),
        "temperature": body.get("temperature"),
        "top_p": body.get("top_p"),
        "tools": body.get("tools") or [],
        "tool_choice": body.get("tool_choice") or "auto",
        "parallel_tool_calls": body.get("parallel_tool_calls", True),
        "previous_response_id": body.get("previous_response_id"),
        "reasoning": body.get("reasoning"),
        "text": body.get("text") or {"format": {"type": "text"}},
        "store": body.get("store", True),
        "metadata": body.get("metadata") or {},
        "error": None,
        "incomplete_details": None,
        "usage": None,
    }


def _complete(shell: dict[str, Any], answer: dict[str, Any]) -> dict[str, Any]:
    choice = answer["choices"][0]
    message = choice["message"]
    output: list[dict[str, Any]] = []
    if message.get("reasoning_content"):
        output.append(_reasoning_item(message["reasoning_content"]))
    if message.get("content"):
        output.append(_message_item(message["content"]))
    for call in message.get("tool_calls") or []:
        output.append(_call_item(call["id"], call["function"]["name"], call["function"]["arguments"]))
    return _finished(shell, output, choice["finish_reason"], answer.get("usage") or {})


def _finished(
    shell: dict[str, Any], output: list[dict[str, Any]], finish: str, usage: dict[str, Any]
) -> dict[str, Any]:
    cut = finish == "length"
    return shell | {
        "status": "incomplete" if cut else "completed",
        "incomplete_details": {"reason": "max_output_tokens"} if cut else None,
        "output": output,
        "usage": {
            "input_tokens": usage.get("prompt_tokens", 0),
            "input_tokens_details": {
                "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
            },
            "output_tokens": usage.get("completion_tokens", 0),
            "output_tokens_details": {
                "reasoning_tokens": (usage.get("completion_tokens_details") or {}).get("reasoning_tokens", 0)
            },
            "total_tokens": usage.get("total_tokens", 0),
        },
    }


def _reasoning_item(text: str) -> dict[str, Any]:
    return {
        "type": "reasoning",
        "id": "rs_" + uuid.uuid4().hex[:24],
        "summary": [{"type": "summary_text", "text": text}],
    }


def _message_item(text: str, status: str = "completed") -> dict[str, Any]:
    part = {"type": "output_text", "text": text, "annotations": []}
    return {
        "type": "message",
        "id": "msg_" + uuid.uuid4().hex[:24],
        "status": status,
        "role": "assistant",
        "content": [part],
    }


def _call_item(call_id: str, name: str, arguments: str, status: str = "completed") -> dict[str, Any]:
    item_id = "fc_" + uuid.uuid4().hex[:24]
    return {
        "type": "function_call",
        "id": item_id,
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }


def _said(output: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A response's output as the chat messages the next request continues from."""
    text = "".join(part["text"] for item in output if item["type"] == "message" for part in item["content"])
    calls = [
        {"id": item["call_id"], "function": {"name": item["name"], "arguments": item["arguments"]}}
        for item in output
        if item["type"] == "function_call"
    ]
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if calls:
        message["tool_calls"] = calls
    return [message]


async def _events(
    chunks: AsyncIterator[Any], shell: dict[str, Any], messages: list[dict[str, Any]], stored: Stored | None
) -> AsyncIterator[str]:
    """OpenAI's chat chunks as the Responses event stream: an output item per kind of content,
    added when its first piece comes and done when another starts or the reply ends."""
    sequence = 0

    def event(kind: str, data: dict[str, Any]) -> str:
        nonlocal sequence
        sequence += 1
        return f"event: {kind}\ndata: {json.dumps({'type': kind, 'sequence_number': sequence, **data})}\n\n"

    yield event("response.created", {"response": shell})
    yield event("response.in_progress", {"response": shell})
    output: list[dict[str, Any]] = []
    current: dict[str, Any] | None = None  # the item being written
    finish = "stop"

    def close() -> list[str]:
        if current is None:
            return []
        index = len(output) - 1
        kind = current["type"]
        closing = []
        if kind == "message":
            part = current["content"][0]
            closing.append(
                event(
                    "response.output_text.done",
                    {
                        "item_id": current["id"],
                        "output_index": index,
                        "content_index": 0,
                        "text": part["text"],
                        "logprobs": [],
                    },
                )
            )
            closing.append(
                event(
                    "response.content_part.done",
                    {"item_id": current["id"], "output_index": index, "content_index": 0, "part": part},
                )
            )
        elif kind == "function_call":
            closing.append(
                event(
                    "response.function_call_arguments.done",
                    {"item_id": current["id"], "output_index": index, "arguments": current["arguments"]},
                )
            )
        elif kind == "reasoning":
            summary = current["summary"][0]
            closing.append(
                event(
                    "response.reasoning_summary_text.done",
                    {
                        "item_id": current["id"],
                        "output_index": index,
                        "summary_index": 0,
                        "text": summary["text"],
                    },
                )
            )
            closing.append(
                event(
                    "response.reasoning_summary_part.done",
                    {"item_id": current["id"], "output_index": index, "summary_index": 0, "part": summary},
                )
            )
        current["status"] = "completed"
        closing.append(event("response.output_item.done", {"output_index": index, "item": current}))
        return closing

    async for raw in chunks:
        chunk = chunk_of(raw)
        if chunk is None:
            continue
        if "error" in chunk:  # a cut reply: the stream says so, and no response.completed
            yield event(
                "error", {"code": "server_error", "message": chunk["error"]["message"], "param": None}
            )
            return
        for choice in chunk.get("choices") or ():
            finish = choice.get("finish_reason") or finish
            delta = choice.get("delta") or {}
            pieces: list[tuple[str, Any]] = []
            if delta.get("reasoning_content"):
                pieces.append(("reasoning", delta["reasoning_content"]))
            if delta.get("content"):
                pieces.append(("message", delta["content"]))
            pieces += [("function_call", part) for part in delta.get("tool_calls") or ()]
            for kind, piece in pieces:
                starts = kind == "function_call" and piece.get("id")
                if current is None or current["type"] != kind or starts:
                    for line in close():
                        yield line
                    if kind == "reasoning":
                        current = _reasoning_item("") | {"status": "in_progress"}
                        current["summary"] = [{"type": "summary_text", "text": ""}]
                    elif kind == "message":
                        current = _message_item("", "in_progress")
                    else:
                        current = _call_item(piece["id"], piece["function"]["name"], "", "in_progress")
                    output.append(current)
                    index = len(output) - 1
                    yield event("response.output_item.added", {"output_index": index, "item": current})
                    if kind == "message":
                        yield event(
                            "response.content_part.added",
                            {
                                "item_id": current["id"],
                                "output_index": index,
                                "content_index": 0,
                                "part": current["content"][0],
                            },
                        )
                    elif kind == "reasoning":
                        yield event(
                            "response.reasoning_summary_part.added",
                            {
                                "item_id": current["id"],
                                "output_index": index,
                                "summary_index": 0,
                                "part": current["summary"][0],
                            },
                        )
                index = len(output) - 1
                if kind == "message":
                    current["content"][0]["text"] += piece
                    yield event(
                        "response.output_text.delta",
                        {
                            "item_id": current["id"],
                            "output_index": index,
                            "content_index": 0,
                            "delta": piece,
                            "logprobs": [],
                        },
                    )
                elif kind == "reasoning":
                    current["summary"][0]["text"] += piece
                    yield event(
                        "response.reasoning_summary_text.delta",
                        {"item_id": current["id"], "output_index": index, "summary_index": 0, "delta": piece},
                    )
                else:
                    arguments = (piece.get("function") or {}).get("arguments") or ""
                    if arguments:
                        current["arguments"] += arguments
                        yield event(
                            "response.function_call_arguments.delta",
                            {"item_id": current["id"], "output_index": index, "delta": arguments},
                        )
        if chunk.get("usage"):
            for line in close():
                yield line
            response = _finished(shell, output, finish, chunk["usage"])
            if stored is not None:
                stored.keep(response["id"], messages + _said(output))
            # response.completed even when the status is "incomplete" (the length limit): the
            # official client's stream helper waits for that event alone.
            yield event("response.completed", {"response": response})
