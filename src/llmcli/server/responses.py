"""OpenAI's Responses API over the same model and worker.

`POST /v1/responses` becomes a chat request answered by the same code as `/v1/chat/completions`,
its events encoded as a response object: output items (a `reasoning` item whose summary is the
thinking, a `message` with `output_text`, `function_call`s), or the Responses event stream
(`response.created`, `response.output_item.added`, `response.output_text.delta`,
`response.function_call_arguments.delta`, …, `response.completed`). Responses are kept in memory
(the newest 256, unless `store: false`), so `previous_response_id` continues a conversation; the
KV cache reuses its prefix as for any re-sent chat. An `input_image` (a data URL, or an http(s)
URL: server/images.py) is taken where the model reads images. Fields that are not honoured
(non-function tools, file inputs and `file_id` images, `include`, `truncation: auto`) are refused.
"""

from __future__ import annotations

import json
import time
import uuid
from collections import OrderedDict
from typing import TYPE_CHECKING, Any, Literal

from fastapi import FastAPI, Request
from pydantic import Field

from llmcli.engine.reasoning import CONTENT, REASONING
from llmcli.engine.reply import TOOL_CALL
from llmcli.engine.tools.reader import CallStart
from llmcli.errors import LlmcliError
from llmcli.server.answers import chat_response
from llmcli.server.blocks import Blocks, Step
from llmcli.server.events import (
    Encoder,
    Failed,
    Outcome,
    Piece,
    Usage,
)
from llmcli.server.images import ImageRef, from_url, image_part, refuse_detail
from llmcli.server.state import RequestError
from llmcli.server.translate import Body, Part, read_body, validated

if TYPE_CHECKING:
    from llmcli.server.fleet import Fleet

KEPT = 256  # stored responses, newest first out of the door last


class ResponsesError(LlmcliError):
    """A request the Responses API cannot take here: a 400."""


class ContentPart(Part):
    type: str  # input_text, output_text (or text), input_image are read; the others (files) refused
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


def install_responses(app: FastAPI, fleet: Fleet) -> None:
    stored = Stored()

    @app.post("/v1/responses")
    async def responses(request: Request) -> Any:
        body = _checked(await read_body(request, ResponsesRequest, ResponsesError))
        served = await fleet.serving(body.get("model"))
        history = _history(stored, body.get("previous_response_id"))
        messages = history + _input(body)
        asked = _chat_request(body, messages)
        shell = _shell(body, served.model_id)
        keep = stored if body.get("store", True) is not False else None
        return await chat_response(served, request, asked, lambda _: ResponsesEncoder(shell, messages, keep))


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
            role = item.get("role")
            messages.append({"role": role, "content": _content(item.get("content"), position, role)})
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


def _content(content: Any, position: int, role: Any) -> str | list[dict[str, Any]]:
    """A message's content: its text, or, where it holds an input_image, its parts in the
    neutral form (server/images.py)."""
    if isinstance(content, str):
        return content
    parts: list[dict[str, Any]] = []
    for index, part in enumerate(content or []):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "input_image" and role == "user":
            parts.append(image_part(_image(part, f"input[{position}].content[{index}]")))
        elif kind in ("input_text", "output_text", "text"):
            parts.append({"type": "text", "text": part.get("text") or ""})
        else:
            taken = " (images are taken in user messages)" if kind == "input_image" else ""
            raise ResponsesError(f"input[{position}]: {kind} parts are not supported here{taken}")
    if any(part["type"] == "image" for part in parts):
        return parts
    return "".join(part["text"] for part in parts)


def _image(part: dict[str, Any], label: str) -> ImageRef:
    """An input_image: its image_url (a data URL, or http(s)); a file_id is refused (no files API)."""
    if part.get("file_id") is not None:
        raise ResponsesError(f"{label}: an input_image's file_id is not supported (no files API here)")
    url = part.get("image_url")
    if not isinstance(url, str):
        raise ResponsesError(f"{label}: an input_image has an image_url (data:image/png;base64,…)")
    refuse_detail(part.get("detail"), label)
    return from_url(url, label, "input_image parts")


def _chat_request(body: dict[str, Any], messages: list[dict[str, Any]]) -> Any:
    from llmcli.server.protocol import ChatRequest

    asked: dict[str, Any] = {"messages": messages, "stream": bool(body.get("stream"))}
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


def _finished(shell: dict[str, Any], output: list[dict[str, Any]], outcomes: list[Outcome]) -> dict[str, Any]:
    cut = outcomes[0].finish == "length"
    usage = Usage.of(outcomes)
    return shell | {
        "status": "incomplete" if cut else "completed",
        "incomplete_details": {"reason": "max_output_tokens"} if cut else None,
        "output": output,
        "usage": {
            "input_tokens": usage.prompt,
            "input_tokens_details": {"cached_tokens": usage.cached},
            "output_tokens": usage.completion,
            "output_tokens_details": {"reasoning_tokens": usage.reasoning or 0},
            "total_tokens": usage.prompt + usage.completion,
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


class ResponsesEncoder(Encoder):
    """A response object, or the Responses event stream: an output item per kind of content
    (blocks.py), added when its first piece comes and done when another starts or the reply
    ends, then `response.completed`. The conversation is stored (`stored`) once it ends."""

    def __init__(self, shell: dict[str, Any], messages: list[dict[str, Any]], stored: Stored | None) -> None:
        self.shell, self.messages, self.stored = shell, messages, stored
        self.sequence = 0
        self.output: list[dict[str, Any]] = []
        self.blocks = Blocks()

    def _event(self, kind: str, data: dict[str, Any]) -> str:
        self.sequence += 1
        return (
            f"event: {kind}\ndata: {json.dumps({'type': kind, 'sequence_number': self.sequence, **data})}\n\n"
        )

    def opening(self) -> str:
        shell = self.shell
        return self._event("response.created", {"response": shell}) + self._event(
            "response.in_progress", {"response": shell}
        )

    def piece(self, piece: Piece) -> str:
        step = self.blocks.feed(piece)
        if step is Step.SKIP:
            return ""
        channel, value = piece.channel, piece.value
        sent = self._added(channel, value) if step is Step.NEW else ""
        current, index = self.output[-1], len(self.output) - 1
        if channel == CONTENT:
            current["content"][0]["text"] += value
            delta = {"item_id": current["id"], "output_index": index, "content_index": 0, "delta": value}
            return sent + self._event("response.output_text.delta", delta | {"logprobs": []})
        if channel == REASONING:
            current["summary"][0]["text"] += value
            delta = {"item_id": current["id"], "output_index": index, "summary_index": 0, "delta": value}
            return sent + self._event("response.reasoning_summary_text.delta", delta)
        if type(value) is CallStart:
            return sent  # its arguments come next
        current["arguments"] += value.text
        delta = {"item_id": current["id"], "output_index": index, "delta": value.text}
        return sent + self._event("response.function_call_arguments.delta", delta)

    def _added(self, channel: str, value: Any) -> str:
        """The item before closed, and a new one added for `channel`'s first piece."""
        sent = self._done()
        if channel == REASONING:
            current = _reasoning_item("") | {"status": "in_progress"}
            current["summary"] = [{"type": "summary_text", "text": ""}]
        elif channel == CONTENT:
            current = _message_item("", "in_progress")
        else:
            current = _call_item(value.id, value.name, "", "in_progress")
        self.output.append(current)
        index = len(self.output) - 1
        sent += self._event("response.output_item.added", {"output_index": index, "item": current})
        if channel != TOOL_CALL:  # a text's part, or a summary's: added empty
            kind, parts, where = (
                ("response.content_part.added", "content", "content_index")
                if channel == CONTENT
                else ("response.reasoning_summary_part.added", "summary", "summary_index")
            )
            added = {"item_id": current["id"], "output_index": index, where: 0, "part": current[parts][0]}
            sent += self._event(kind, added)
        return sent

    def _done(self) -> str:
        """The item being written, done."""
        if not self.output:
            return ""
        current, index = self.output[-1], len(self.output) - 1
        kind, item_id = current["type"], current["id"]
        sent = ""
        if kind == "message":
            part = current["content"][0]
            where = {"item_id": item_id, "output_index": index, "content_index": 0}
            sent += self._event("response.output_text.done", where | {"text": part["text"], "logprobs": []})
            sent += self._event("response.content_part.done", where | {"part": part})
        elif kind == "function_call":
            done = {"item_id": item_id, "output_index": index, "arguments": current["arguments"]}
            sent += self._event("response.function_call_arguments.done", done)
        elif kind == "reasoning":
            summary = current["summary"][0]
            where = {"item_id": item_id, "output_index": index, "summary_index": 0}
            sent += self._event("response.reasoning_summary_text.done", where | {"text": summary["text"]})
            sent += self._event("response.reasoning_summary_part.done", where | {"part": summary})
        current["status"] = "completed"
        return sent + self._event("response.output_item.done", {"output_index": index, "item": current})

    def closing(self, outcomes: list[Outcome]) -> str:
        sent = self._done()
        response = _finished(self.shell, self.output, outcomes)
        self._store(response)
        # response.completed even when the status is "incomplete" (the length limit): the
        # official client's stream helper waits for that event alone.
        return sent + self._event("response.completed", {"response": response})

    def failed(self, failed: Failed) -> str:  # a cut reply: the stream says so, and no response.completed
        return self._event("error", {"code": "server_error", "message": failed.message, "param": None})

    def whole(self, outcomes: list[Outcome]) -> dict[str, Any]:
        outcome = outcomes[0]
        output: list[dict[str, Any]] = []
        if outcome.thinking:
            output.append(_reasoning_item(outcome.thinking))
        if outcome.text:
            output.append(_message_item(outcome.text))
        for call in outcome.tool_calls:
            output.append(_call_item(call.id, call.name, call.arguments))
        response = _finished(self.shell, output, outcomes)
        self._store(response)
        return response

    def _store(self, response: dict[str, Any]) -> None:
        if self.stored is not None:
            self.stored.keep(response["id"], self.messages + _said(response["output"]))
