"""OpenAI's Responses API over the same model and worker.

`POST /v1/responses` becomes a chat request answered by the same code as `/v1/chat/completions`,
its events encoded as a response object: output items (a `reasoning` item whose summary is the
thinking, a `message` with `output_text`, `function_call`s), or the Responses event stream
(`response.created`, `response.output_item.added`, `response.output_text.delta`,
`response.function_call_arguments.delta`, …, `response.completed`). Responses are kept in memory
(the newest 256, unless `store: false`), so `previous_response_id` continues a conversation; the
KV cache reuses its prefix as for any re-sent chat; `GET` and `DELETE /v1/responses/{id}` read
and remove a stored one, and `POST /v1/responses/input_tokens` counts a request's prompt;
`POST /v1/responses/compact` is refused by name (NO_COMPACT). An
`input_image` (a data URL, or an http(s) URL: server/images.py) is taken where the model reads
images. With `include: ["reasoning.encrypted_content"]` (what a client that stores nothing
asks) each reasoning item carries its thinking signed (reasoning_seal.py), taken back as input.
Function, custom and namespace tools are offered, hosted ones refused or dropped (responses_tools.py).
Fields that are not honoured (file inputs and `file_id` images, other `include` values,
`truncation: auto`) are refused.

Custom tools (Codex CLI's `apply_patch`, with a Lark grammar) are offered as functions of one
string, `input`, held to their grammar (engine/tools/freeform.py); their calls come back as
`custom_tool_call` items with the raw input (`response.custom_tool_call_input.delta` as it
streams), and `custom_tool_call` / `custom_tool_call_output` input items are taken back.
"""

from __future__ import annotations

import json
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from fastapi import FastAPI, Request
from pydantic import Field

from llmcli.config.paths import state_dir
from llmcli.engine.reasoning import CONTENT, REASONING
from llmcli.engine.reply import TOOL_CALL
from llmcli.engine.tools.freeform import call_input, input_so_far
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
from llmcli.server.prompts import chat_prompt
from llmcli.server.protocol import ChatRequest
from llmcli.server.reasoning_seal import ReasoningSeal
from llmcli.server.responses_tools import offered_tools
from llmcli.server.state import RequestError
from llmcli.server.translate import Body, Part, read_body, validated

if TYPE_CHECKING:
    from llmcli.server.fleet import Fleet
    from llmcli.server.hosted_tools import HostedTools

KEPT = 256  # stored responses, newest first out of the door last
ENCRYPTED_REASONING = "reasoning.encrypted_content"  # the one `include` honoured
# OpenAI's compaction endpoint returns an opaque item only its own servers read back. Codex CLI
# calls it for OpenAI and Azure alone; for a custom provider it compacts with a summary turn on
# /v1/responses (measured with codex 0.171.0, whatever its x-codex-beta-features header says).
# reasoning.effort onto the levels a chat template reads (Codex CLI sends xhigh for its GPT-5
# models); `none` turns the thinking off instead. Where the template reads no level, effort is a
# hint the model's own thinking already answers (as on the Anthropic route): nothing is sent.
EFFORTS = {"minimal": "minimal", "low": "low", "medium": "medium", "high": "high", "xhigh": "high"}
# text.verbosity (Codex CLI sends low for its GPT-5 models): what OpenAI's models are told, said
# to the model at the end of the system message; medium, the default, adds nothing.
VERBOSITY = {
    "low": "Be concise: answer in as few words as the task allows.",
    "high": "Be thorough: answer in full detail.",
}
# reasoning.summary: the reasoning item's summary is the model's thinking whole, which is what
# `auto` leaves to the server and `detailed` asks for; a concise one would take a second pass.
SUMMARIES = ("auto", "detailed")
NO_COMPACT = (
    "POST /v1/responses/compact is not supported here (no compacted state to hand out): "
    "compact with a summary turn on /v1/responses, as Codex CLI does for a custom provider"
)


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
    namespace: str | None = None  # a call to a namespace tool's function (responses_tools.py)
    arguments: str | None = None
    input: str | None = None  # a custom_tool_call's
    output: str | list[ContentPart] | None = None  # a text, or input_text parts (Codex sends both)
    encrypted_content: str | None = None  # a reasoning item this server signed


class Format(Body):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | bool | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextOptions(Body):
    format: Format | None = None
    verbosity: Literal["low", "medium", "high"] | None = None  # a line in the system message (VERBOSITY)


class Reasoning(Body):
    """effort: the template's own reasoning_effort where it reads one (EFFORTS), `none` the
    thinking off; summary: the reasoning item's summary is the thinking whole (SUMMARIES)."""

    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None


class Tool(Part):
    type: str  # function, custom and namespace tools: responses_tools.py refuses or drops the others
    name: str | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedTool(Body):
    type: Literal["function", "custom"]
    name: str


class InputTokensRequest(Body):
    """`POST /v1/responses/input_tokens`: what a response's prompt is made of, counted."""

    model: str | None = None
    input: str | list[Item] | None = None
    instructions: str | None = None
    text: TextOptions | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["auto", "none", "required"] | NamedTool | None = None
    parallel_tool_calls: bool | None = None
    reasoning: Reasoning | None = None
    previous_response_id: str | None = None
    truncation: Literal["auto", "disabled"] | None = None


class ResponsesRequest(InputTokensRequest):
    """The fields taken; metadata, client_metadata, user and service_tier change nothing here,
    prompt_cache_key is a hint for the slot (scheduler.Slots). Any other field is refused, never
    ignored."""

    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    include: list[str] | None = None
    client_metadata: dict[str, str] | None = None


class _ResponsesChat(ChatRequest):
    """The chat request a response becomes: custom tools taken, their calls answered as
    custom_tool_call items."""

    custom_tools = True
    effort_is_a_hint = True


@dataclass(frozen=True)
class Kept:
    response: dict[str, Any]  # as it was answered: GET /v1/responses/{id} gives it again
    messages: list[dict[str, Any]]  # its whole conversation, as chat messages


class Stored(OrderedDict[str, Kept]):
    """Each stored response, and its conversation; the oldest leave first."""

    def keep(self, response: dict[str, Any], messages: list[dict[str, Any]]) -> None:
        self[response["id"]] = Kept(response, messages)
        while len(self) > KEPT:
            self.popitem(last=False)

    def get_or_404(self, response_id: Any, param: str | None = None) -> Kept:
        if response_id not in self:
            message = f"no stored response {response_id!r} (kept: the newest {KEPT}, unless store was false)"
            raise RequestError(404, message, param)
        return self[response_id]


def install_responses(app: FastAPI, fleet: Fleet, hosted: HostedTools) -> None:
    """The Responses routes over `fleet`'s models; `hosted`: what the server does with hosted
    tools (web search, …): refuse or drop them (hosted_tools.py)."""
    stored = Stored()
    seal = ReasoningSeal.kept_under(state_dir())

    @app.post("/v1/responses")
    async def responses(request: Request) -> Any:
        body = _checked(await read_body(request, ResponsesRequest, ResponsesError))
        served = await fleet.serving(body.get("model"))
        reading = _Reading(body, stored, seal, hosted)
        shell = _shell(body, served.model_id)
        keep = stored if body.get("store", True) is not False else None
        sealing = seal if _includes_encrypted_reasoning(body) else None

        def encoder(_: Any) -> ResponsesEncoder:
            return ResponsesEncoder(shell, reading.messages, keep, reading.tools.namespace_of, sealing)

        return await chat_response(served, request, reading.asked, encoder)

    @app.post("/v1/responses/input_tokens")
    async def input_tokens(request: Request) -> Any:
        body = _checked(await read_body(request, InputTokensRequest, ResponsesError))
        served = await fleet.serving(body.get("model"))
        ids, _ = await chat_prompt(served, _Reading(body, stored, seal, hosted).asked)
        return {"object": "response.input_tokens", "input_tokens": len(ids)}

    @app.post("/v1/responses/compact")
    async def compact() -> Any:
        raise RequestError(404, NO_COMPACT)

    @app.get("/v1/responses/{response_id}")
    async def stored_response(response_id: str, request: Request) -> Any:
        if request.query_params.get("stream") not in (None, "false"):
            raise ResponsesError("stream is not supported here for a stored response: it is read whole")
        return stored.get_or_404(response_id).response

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str) -> Any:
        stored.get_or_404(response_id)
        del stored[response_id]
        return {"id": response_id, "object": "response", "deleted": True}


class _Reading:
    """A Responses request read: its conversation as chat messages (the stored history first),
    the tools offered, and the chat request they make."""

    def __init__(
        self, body: dict[str, Any], stored: Stored, seal: ReasoningSeal, hosted: HostedTools
    ) -> None:
        previous = body.get("previous_response_id")
        history = [] if previous is None else stored.get_or_404(previous, "previous_response_id").messages
        try:
            self.tools = offered_tools(body.get("tools"), hosted)
            self.messages = [dict(message) for message in history] + _input(body, seal)
        except LlmcliError as error:
            raise ResponsesError(error.message) from None
        self.asked = _chat_request(body, self.messages, self.tools.chat)


def _checked(body: dict[str, Any]) -> dict[str, Any]:
    summary = (body.get("reasoning") or {}).get("summary")
    if summary not in (None, *SUMMARIES):
        whole = "the summary is the thinking whole (auto, detailed)"
        raise ResponsesError(f"reasoning.summary {summary} is not supported here: {whole}")
    if body.get("truncation") not in (None, "disabled"):
        raise ResponsesError("truncation auto is not supported: a request over the context is refused")
    for value in body.get("include") or []:
        if value != ENCRYPTED_REASONING:
            raise ResponsesError(f"include: {value} is not supported here ({ENCRYPTED_REASONING} is)")
    return body


def _includes_encrypted_reasoning(body: dict[str, Any]) -> bool:
    return ENCRYPTED_REASONING in (body.get("include") or [])


def _input(body: dict[str, Any], seal: ReasoningSeal | None = None) -> list[dict[str, Any]]:
    """`instructions` and `input` (text, or items) as chat messages; `seal` checks the reasoning
    items' encrypted_content (none is taken without it)."""
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
        elif kind in ("function_call", "custom_tool_call"):
            _add_call(messages, item.get("call_id"), item.get("name"), _call_arguments(item))
        elif kind in ("function_call_output", "custom_tool_call_output"):
            output = _output_text(item.get("output"), position)
            messages.append({"role": "tool", "tool_call_id": item.get("call_id"), "content": output})
        elif kind == "reasoning":
            if item.get("encrypted_content") is not None:  # checked: it came from the network
                if seal is None:
                    raise ResponsesError(f"input[{position}]: encrypted_content is not taken here")
                seal.open(item["encrypted_content"], f"input[{position}]")
            continue  # earlier thinking is not shown to the model again, as on every route here
        else:
            raise ResponsesError(f"input[{position}]: {kind} items are not supported here")
    return messages


def _call_arguments(item: dict[str, Any]) -> Any:
    """An earlier call's arguments as the template shows them: a custom call's raw input as the
    one string argument its tool is offered with (engine/tools/freeform.py)."""
    if item.get("type") == "custom_tool_call":
        return json.dumps({"input": item.get("input") or ""}, ensure_ascii=False)
    return item.get("arguments")


def _output_text(output: Any, position: int) -> str:
    """A tool call's output: its text, or the text of its parts (Codex sends input_text parts)."""
    if not isinstance(output, list):
        return output or ""
    kinds = {part.get("type") for part in output} - {"input_text", "output_text", "text"}
    if kinds:
        raise ResponsesError(f"input[{position}]: a tool output's {min(kinds)} parts are not supported here")
    return "".join(part.get("text") or "" for part in output)


def _add_call(messages: list[dict[str, Any]], call_id: Any, name: Any, arguments: Any) -> None:
    """A call, in the assistant message before it where that one holds calls already."""
    call = {"id": call_id, "function": {"name": name, "arguments": arguments}}
    if messages and messages[-1]["role"] == "assistant" and messages[-1].get("tool_calls"):
        messages[-1]["tool_calls"].append(call)
    else:
        messages.append({"role": "assistant", "content": "", "tool_calls": [call]})


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


def _chat_request(body: dict[str, Any], messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> Any:
    text = body.get("text") if isinstance(body.get("text"), dict) else {}
    messages = _told(messages, VERBOSITY.get(text.get("verbosity")))
    asked: dict[str, Any] = {"messages": messages, "stream": bool(body.get("stream"))}
    for name, chat_name in (
        ("max_output_tokens", "max_tokens"),
        ("temperature", "temperature"),
        ("top_p", "top_p"),
    ):
        if body.get(name) is not None:
            asked[chat_name] = body[name]
    form = text.get("format") or {}
    if form.get("type") == "json_object":
        asked["response_format"] = {"type": "json_object"}
    elif form.get("type") == "json_schema":
        schema = {"name": form.get("name") or "format", "schema": form.get("schema", True)}
        asked["response_format"] = {"type": "json_schema", "json_schema": schema}
    if tools:
        asked["tools"] = tools
    choice = body.get("tool_choice")
    if isinstance(choice, dict):
        choice = {"type": "function", "function": {"name": choice.get("name")}}
    if choice is not None:
        asked["tool_choice"] = choice
    if body.get("parallel_tool_calls") is not None:
        asked["parallel_tool_calls"] = body["parallel_tool_calls"]
    if body.get("prompt_cache_key") is not None:
        asked["prompt_cache_key"] = body["prompt_cache_key"]
    effort = (body.get("reasoning") or {}).get("effort")
    if effort == "none":
        asked["chat_template_kwargs"] = {"enable_thinking": False}
    elif effort:
        asked["reasoning_effort"] = EFFORTS[effort]
    return validated(_ResponsesChat, asked, ResponsesError)


def _told(messages: list[dict[str, Any]], line: str | None) -> list[dict[str, Any]]:
    """`messages` with `line` at the end of the system message (one made where none leads),
    for this request alone: the conversation stored for the next one is left as it came."""
    if line is None:
        return messages
    head = messages[0] if messages else {}
    if head.get("role") in ("system", "developer") and isinstance(head.get("content"), str):
        return [head | {"content": f"{head['content']}\n\n{line}"}, *messages[1:]]
    return [{"role": "system", "content": line}, *messages]


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


def _custom_call_item(call_id: str, name: str, text: str, status: str = "completed") -> dict[str, Any]:
    """A custom tool's call: a function_call's fields, its raw `input` for the arguments."""
    item = _call_item(call_id, name, "", status)
    del item["arguments"]
    return item | {"type": "custom_tool_call", "id": "ctc_" + item["id"].removeprefix("fc_"), "input": text}


def _custom_names(shell: dict[str, Any]) -> frozenset[str]:
    """The custom tools a request offers: their calls are custom_tool_call items."""
    return frozenset(tool.get("name") for tool in shell.get("tools") or () if tool.get("type") == "custom")


def _said(output: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A response's output as the chat messages the next request continues from."""
    text = "".join(part["text"] for item in output if item["type"] == "message" for part in item["content"])
    calls = [
        {"id": item["call_id"], "function": {"name": item["name"], "arguments": _call_arguments(item)}}
        for item in output
        if item["type"] in ("function_call", "custom_tool_call")
    ]
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if calls:
        message["tool_calls"] = calls
    return [message]


class ResponsesEncoder(Encoder):
    """A response object, or the Responses event stream: an output item per kind of content
    (blocks.py), added when its first piece comes and done when another starts or the reply
    ends, then `response.completed`. The conversation is stored (`stored`) once it ends."""

    def __init__(
        self,
        shell: dict[str, Any],
        messages: list[dict[str, Any]],
        stored: Stored | None,
        namespace_of: dict[str, str] | None = None,
        seal: ReasoningSeal | None = None,
    ) -> None:
        """`namespace_of`: the namespace each namespaced function's calls come back under;
        `seal`: where the client asked for the reasoning as encrypted_content."""
        self.shell, self.messages, self.stored = shell, messages, stored
        self.namespace_of, self.seal = namespace_of or {}, seal
        self.sequence = 0
        self.output: list[dict[str, Any]] = []
        self.blocks = Blocks()
        self.custom = _custom_names(shell)
        self.arguments = ""  # a custom call's arguments so far (its item holds the input decoded)

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
        if current["type"] == "custom_tool_call":
            return sent + self._input_delta(current, index, value.text)
        current["arguments"] += value.text
        delta = {"item_id": current["id"], "output_index": index, "delta": value.text}
        return sent + self._event("response.function_call_arguments.delta", delta)

    def _input_delta(self, current: dict[str, Any], index: int, text: str) -> str:
        """A custom call's input as its arguments stream: what each piece completes, decoded."""
        self.arguments += text
        so_far = input_so_far(self.arguments)
        delta = so_far[len(current["input"]) :]
        if not delta:
            return ""
        current["input"] = so_far
        event = {"item_id": current["id"], "output_index": index, "delta": delta}
        return self._event("response.custom_tool_call_input.delta", event)

    def _added(self, channel: str, value: Any) -> str:
        """The item before closed, and a new one added for `channel`'s first piece."""
        sent = self._done()
        if channel == REASONING:
            current = _reasoning_item("") | {"status": "in_progress"}
            current["summary"] = [{"type": "summary_text", "text": ""}]
        elif channel == CONTENT:
            current = _message_item("", "in_progress")
        elif value.name in self.custom:
            current = _custom_call_item(value.id, value.name, "", "in_progress")
            self.arguments = ""
        else:
            current = self._call_item(value.id, value.name, "", "in_progress")
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
        elif kind == "custom_tool_call":
            done = {"item_id": item_id, "output_index": index, "input": current["input"]}
            sent += self._event("response.custom_tool_call_input.done", done)
        elif kind == "reasoning":
            self._sealed(current)
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
            output.append(self._sealed(_reasoning_item(outcome.thinking)))
        if outcome.text:
            output.append(_message_item(outcome.text))
        for call in outcome.tool_calls:
            if call.name in self.custom:
                output.append(_custom_call_item(call.id, call.name, call_input(call.arguments)))
            else:
                output.append(self._call_item(call.id, call.name, call.arguments))
        response = _finished(self.shell, output, outcomes)
        self._store(response)
        return response

    def _store(self, response: dict[str, Any]) -> None:
        if self.stored is not None:
            self.stored.keep(response, self.messages + _said(response["output"]))

    def _call_item(
        self, call_id: str, name: str, arguments: str, status: str = "completed"
    ) -> dict[str, Any]:
        item = _call_item(call_id, name, arguments, status)
        if name in self.namespace_of:
            item["namespace"] = self.namespace_of[name]
        return item

    def _sealed(self, item: dict[str, Any]) -> dict[str, Any]:
        """A reasoning item with its thinking as encrypted_content, where the client asked."""
        if self.seal is not None:
            item["encrypted_content"] = self.seal.seal(item["summary"][0]["text"])
        return item
