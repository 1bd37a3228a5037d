"""Anthropic's Messages API over the same model and worker.

`POST /v1/messages` becomes an OpenAI chat request answered by the same code as
`/v1/chat/completions`, its events encoded as Anthropic's: a message with content blocks
(thinking, text, tool_use), or Anthropic's event stream (`message_start`, `content_block_start`,
`content_block_delta` with `text_delta` / `thinking_delta` / `input_json_delta`,
`content_block_stop`, `message_delta` with the stop reason and usage, `message_stop`).
`POST /v1/messages/count_tokens` renders the prompt and counts it. A final assistant message
is a prefill: the reply continues its text. Errors come in Anthropic's shape. An image block
in a user turn (base64, or a url source: server/images.py) is taken where the model reads
images; a file source and document blocks are refused; earlier `thinking` blocks are not shown
to the model again (as Anthropic's API drops them from earlier turns). Claude Code's requests
are taken as it sends them (tests/test_claude_code_requests.py replays them): its system
message among the messages, adaptive thinking, output_config, its clear_thinking edit, and
context errors in the words it reads to retry with a max_tokens that fits.
"""

from __future__ import annotations

import functools
import json
import uuid
from typing import TYPE_CHECKING, Any, Literal

from fastapi import FastAPI, Request, Response
from pydantic import Field, model_validator

from llmcli.engine.reasoning import CONTENT
from llmcli.engine.reply import TOOL_CALL
from llmcli.errors import LlmcliError
from llmcli.server.answers import respond
from llmcli.server.anthropic_tools import function_tool, screen_hosted_tools
from llmcli.server.blocks import Blocks, Step
from llmcli.server.events import Encoder, Failed, Outcome, Piece, Usage, call_input
from llmcli.server.images import ImageRef, from_base64, from_url, image_part
from llmcli.server.prompts import chat_prompt
from llmcli.server.state import RequestError
from llmcli.server.translate import Body, Part, read_json, validated

if TYPE_CHECKING:
    from llmcli.server.fleet import Fleet
    from llmcli.server.hosted_tools import HostedTools
    from llmcli.server.state import Served
    from llmcli.server.worker import Job

STOP_REASONS = {"length": "max_tokens", "tool_calls": "tool_use", "stop": "end_turn"}
CHOICES = {"auto": "auto", "any": "required", "none": "none"}
# Claude Code's first system block, "x-anthropic-billing-header: cc_version=…; …": attribution
# for Anthropic's billing, which its API takes out of the prompt; shown to a model here, it would
# only cost tokens (and change the prompt's start with each Claude Code version).
BILLING_HEADER = "x-anthropic-billing-header:"
EFFORTS = {"low": "low", "medium": "medium", "high": "high", "xhigh": "high", "max": "high"}


class AnthropicError(LlmcliError):
    """A request the Messages API cannot take here: a 400 in Anthropic's error shape."""


class Block(Part):
    """A content block: text, image, tool_use, tool_result (its content text or blocks),
    thinking; the adapter refuses the other kinds (document)."""

    type: str
    text: str | None = None
    id: str | None = None
    name: str | None = None
    input: dict[str, Any] | None = None
    tool_use_id: str | None = None
    content: str | list[Block] | None = None


class Message(Body):
    role: Literal["user", "assistant", "system"]  # system: Claude Code's mid-conversation system beta
    content: str | list[Block]


class Tool(Body):
    type: Literal["custom"] | None = None  # the others: anthropic_tools.screen_hosted_tools
    name: str
    description: str | None = None
    input_schema: dict[str, Any]
    cache_control: dict[str, Any] | None = None
    strict: bool | None = None  # a call is always held to its schema here (a grammar)


class ToolChoice(Body):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class Thinking(Body):
    type: Literal["enabled", "disabled", "adaptive"]  # adaptive: the model's own choice, no budget
    budget_tokens: int | None = Field(default=None, ge=1)

    @model_validator(mode="after")
    def _budget_when_enabled(self) -> Thinking:
        if self.type != "enabled" and self.budget_tokens is not None:
            raise ValueError(f"budget_tokens is for thinking enabled: thinking {self.type} has no budget")
        return self


class ContextEdit(Body):
    """An edit of context_management: clearing earlier thinking is what happens here anyway;
    clearing earlier tool results (clear_tool_uses_…) is refused, not run."""

    type: str
    keep: str | dict[str, Any] | None = None

    @model_validator(mode="before")
    @classmethod
    def _clearing_thinking_only(cls, edit: Any) -> Any:
        kind = edit.get("type") if isinstance(edit, dict) else None
        if isinstance(kind, str) and kind != "clear_thinking_20251015":
            raise ValueError(f"{kind} is not supported here (clear_thinking_20251015 is)")
        return edit


class ContextManagement(Body):
    edits: list[ContextEdit] = Field(default_factory=list)


class OutputFormatField(Body):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(Body):
    """effort: the template's reasoning_effort where it reads one, else (a hint by Anthropic's
    definition, not a budget) nothing; format: the reply as JSON valid under the schema."""

    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None
    format: OutputFormatField | None = None


class MessagesRequest(Body):
    """The fields taken; metadata, service_tier and cache_control change nothing here (the KV
    cache is reused by prefix on its own), nor does context_management's one edit taken (earlier
    thinking is never shown). Any other field is refused, never ignored."""

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
    context_management: ContextManagement | None = None
    output_config: OutputConfig | None = None


class CountRequest(MessagesRequest):
    max_tokens: int = 1  # a count generates nothing


def install_anthropic(app: FastAPI, fleet: Fleet, hosted: HostedTools) -> None:
    """The Messages routes over `fleet`'s models; `hosted`: what the server does with Anthropic's
    server tools (web search, …): refuse or drop them (anthropic_tools.screen_hosted_tools)."""

    @app.head("/")
    async def reachable() -> Response:  # Claude Code's connection warm-up, before its first request
        return Response()

    @app.post("/v1/messages")
    async def messages(request: Request) -> Any:
        body = await _read(request, MessagesRequest, hosted)
        served = await fleet.serving(body.get("model"))
        asked, prefill = _chat_request(body, _reads_effort(served))
        encoder_for = functools.partial(AnthropicEncoder, served.model_id)
        request.state.ticket = ticket = served.admit()  # given back by the worker or the error handler
        ids, turn = await chat_prompt(served, asked, prefill)
        _check_room(len(ids), body["max_tokens"], served.loaded.context_length)
        return await respond(served, request, asked, [ids], ticket, encoder_for, chat=True, tools=turn)

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(request: Request) -> dict[str, Any]:
        body = await _read(request, CountRequest, hosted)
        served = await fleet.serving(body.get("model"))
        asked, prefill = _chat_request(body | {"max_tokens": 1}, _reads_effort(served))
        ids, _ = await chat_prompt(served, asked, prefill)
        return {"input_tokens": len(ids)}  # an image's tokens among them (its placeholder's)


async def _read(request: Request, model: type[MessagesRequest], hosted: HostedTools) -> dict[str, Any]:
    """The body, its hosted tools screened first (their fields are their own), then validated."""
    body = await read_json(request, AnthropicError)
    if "tools" in body:
        body["tools"] = screen_hosted_tools(body["tools"], hosted)
    validated(model, body, AnthropicError)
    return body


def _reads_effort(served: Served) -> bool:
    template = getattr(served.loaded.tokenizer, "chat_template", "") or ""
    return "reasoning_effort" in str(template)


def _check_room(prompt: int, max_tokens: int, context: int) -> None:
    """A prompt and max_tokens the context cannot hold, refused in Anthropic's own words: Claude
    Code reads them, and retries with the max_tokens that fits (or compacts a prompt too long)."""
    if prompt >= context:
        raise RequestError(400, f"prompt is too long: {prompt} tokens > {context - 1} maximum", "messages")
    if prompt + max_tokens > context:
        message = (
            f"input length and `max_tokens` exceed context limit: {prompt} + {max_tokens} > {context}, "
            "decrease input length or `max_tokens` and try again"
        )
        raise RequestError(400, message, "max_tokens")


def _chat_request(body: dict[str, Any], reads_effort: bool = False) -> tuple[Any, bool]:
    """The Messages request as an OpenAI chat request (validated: a bad value is a 400), and
    whether its final assistant message is a prefill for the reply to continue. `reads_effort`:
    the model's template reads reasoning_effort, which output_config.effort then sets."""
    from llmcli.server.protocol import ChatRequest

    messages = _system(body.get("system"))
    for position, message in enumerate(body.get("messages") or []):
        messages += _turn(message, position)
    messages = _late_systems_folded(messages)
    prefill = _prefill(messages)
    asked: dict[str, Any] = {
        "messages": messages,
        "max_tokens": body["max_tokens"],
        "stream": bool(body.get("stream")),
    }
    for name, openai_name in (("temperature", "temperature"), ("top_p", "top_p"), ("top_k", "top_k")):
        if body.get(name) is not None:
            asked[openai_name] = body[name]
    if body.get("stop_sequences"):
        asked["stop"] = body["stop_sequences"]
    if body.get("tools"):
        asked["tools"] = [function_tool(tool) for tool in body["tools"]]
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
    output = body.get("output_config") or {}
    if output.get("effort") and reads_effort:
        asked["reasoning_effort"] = EFFORTS[output["effort"]]
    if output.get("format"):
        asked["response_format"] = {
            "type": "json_schema",
            "json_schema": {"name": "output_config.format", "schema": output["format"]["schema"]},
        }
    return validated(ChatRequest, asked, AnthropicError), prefill


def _late_systems_folded(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A system message after the conversation started (Claude Code's mid-conversation system
    beta) joins the user turn before it, or the one after it where none is before: most
    templates refuse a system message anywhere but first (Qwen's), and every one takes a user
    turn. Deterministic, so the next request's prompt starts with this one's (the KV cache)."""
    folded: list[dict[str, Any]] = []
    pending = ""  # system text waiting for the next user turn
    for position, message in enumerate(messages):
        if message["role"] != "system" or position == 0:
            if pending and message["role"] == "user":
                message = {**message, "content": _joined(pending, message["content"])}
                pending = ""
            folded.append(message)
        elif folded and folded[-1]["role"] == "user":
            folded[-1] = {**folded[-1], "content": _joined(folded[-1]["content"], message["content"])}
        else:
            pending = _joined(pending, message["content"]) if pending else message["content"]
    if pending:
        folded.append({"role": "user", "content": pending})
    return folded


def _joined(first: Any, second: Any) -> Any:
    """Two contents as one, a blank line between: texts, or image parts with text parts."""
    if isinstance(first, str) and isinstance(second, str):
        return f"{first}\n\n{second}"
    parts = [first] if isinstance(first, list) else [[{"type": "text", "text": first}]]
    parts += [second] if isinstance(second, list) else [[{"type": "text", "text": second}]]
    return [*parts[0], {"type": "text", "text": "\n\n"}, *parts[1]]


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
        texts = (_text_of(block, "system") for block in system)
        system = "".join(text for text in texts if not text.startswith(BILLING_HEADER))
    return [{"role": "system", "content": system}]


def _turn(message: Any, position: int) -> list[dict[str, Any]]:
    """One Messages turn as OpenAI messages: a user's tool_result blocks become tool messages,
    an assistant's tool_use blocks its tool_calls, a user's image blocks image parts."""
    where = f"messages.{position}"
    if not isinstance(message, dict) or message.get("role") not in ("user", "assistant", "system"):
        raise AnthropicError(f"{where}: a message has the role user, assistant or system")
    role, content = message["role"], message.get("content")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if role == "system":  # text blocks only, as the top-level system takes
        return [{"role": role, "content": "".join(_text_of(block, where) for block in content or [])}]
    text, calls, results, parts = "", [], [], []
    for index, block in enumerate(content or []):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text":
            text += block.get("text") or ""
            parts.append({"type": "text", "text": block.get("text") or ""})
        elif kind == "image" and role == "user":
            parts.append(image_part(_image(block.get("source"), f"messages[{position}].content[{index}]")))
        elif kind == "tool_use":
            arguments = json.dumps(block.get("input") or {})
            calls.append(
                {"id": block.get("id"), "function": {"name": block.get("name"), "arguments": arguments}}
            )
        elif kind == "tool_result":
            result = block.get("content")
            result = result if isinstance(result, str) else "".join(_text_of(b, where) for b in result or [])
            if block.get("is_error") is True:  # a tool message has no flag: the model reads it in the text
                result = f"Error: {result}"
            results.append({"role": "tool", "tool_call_id": block.get("tool_use_id"), "content": result})
        elif kind in ("thinking", "redacted_thinking"):
            continue  # earlier thinking is not shown to the model again
        elif kind == "image":
            raise AnthropicError(f"{where}: image blocks are taken in user turns only")
        else:
            raise AnthropicError(f"{where}: {kind} blocks are not supported here")
    shaped: list[dict[str, Any]] = [*results]
    images = any(part["type"] == "image" for part in parts)
    if text or calls or images or not results:
        turn: dict[str, Any] = {"role": role, "content": parts if images else text}
        if calls:
            turn["tool_calls"] = calls
        shaped.append(turn)
    return shaped


def _image(source: Any, label: str) -> ImageRef:
    """An image block's source: base64 with its media type, or a URL; a file is refused (no
    files API here)."""
    kind = source.get("type") if isinstance(source, dict) else None
    if kind == "base64" and isinstance(source.get("data"), str):
        return from_base64(source["data"], label, "image blocks", str(source.get("media_type")))
    if kind == "url" and isinstance(source.get("url"), str):
        return from_url(source["url"], label, "image blocks")
    if kind == "file":
        raise AnthropicError(f"{label}: an image's file source is not supported here: there is no files API")
    raise AnthropicError(f"{label}: an image block's source is base64 (media_type, data) or a url")


def _text_of(block: Any, where: str) -> str:
    if not isinstance(block, dict) or block.get("type") != "text":
        raise AnthropicError(f"{where}: only text blocks are supported here")
    return block.get("text") or ""


class AnthropicEncoder(Encoder):
    """A message with content blocks (thinking, text, tool_use), or Anthropic's event stream:
    `message_start`, a block per kind of content (blocks.py), `message_delta` with the stop
    reason and usage, `message_stop`."""

    def __init__(self, model: str, jobs: list[Job]) -> None:
        self.model = model  # the model that answered, as the server names it
        self.prompt_tokens = len(jobs[0].ids)
        self.blocks = Blocks()

    def opening(self) -> str:
        start = {"id": _message_id(), "type": "message", "role": "assistant", "model": self.model}
        usage = {"input_tokens": self.prompt_tokens, "output_tokens": 0, "cache_read_input_tokens": 0}
        start |= {"content": [], "stop_reason": None, "stop_sequence": None, "usage": usage}
        return _event("message_start", {"message": start})

    def piece(self, piece: Piece) -> str:
        blocks = self.blocks
        step = blocks.feed(piece)
        if step is Step.SKIP:
            return ""
        channel, value = piece.channel, piece.value
        sent = ""
        if step is Step.NEW:
            if blocks.closes_one:
                sent = _event("content_block_stop", {"index": blocks.index - 1})
            if channel == TOOL_CALL:
                block = {"type": "tool_use", "id": value.id, "name": value.name, "input": {}}
            elif channel == CONTENT:
                block = {"type": "text", "text": ""}
            else:
                block = {"type": "thinking", "thinking": "", "signature": ""}
            sent += _event("content_block_start", {"index": blocks.index, "content_block": block})
            if channel == TOOL_CALL:
                return sent  # its arguments come next
        if channel == TOOL_CALL:
            delta = {"type": "input_json_delta", "partial_json": value.text}
        elif channel == CONTENT:
            delta = {"type": "text_delta", "text": value}
        else:
            delta = {"type": "thinking_delta", "thinking": value}
        return sent + _event("content_block_delta", {"index": blocks.index, "delta": delta})

    def closing(self, outcomes: list[Outcome]) -> str:
        sent = _event("content_block_stop", {"index": self.blocks.index}) if self.blocks.index >= 0 else ""
        outcome = outcomes[0]
        reason = _stop(outcome.finish, outcome.stop_sequence)
        sent += _event("message_delta", {"delta": reason, "usage": _usage(outcomes)})
        return sent + _event("message_stop", {})

    def failed(self, failed: Failed) -> str:  # a cut reply: Anthropic's error event, and no message_stop
        return _event("error", {"error": {"type": "api_error", "message": failed.message}})

    def whole(self, outcomes: list[Outcome]) -> dict[str, Any]:
        outcome = outcomes[0]
        content: list[dict[str, Any]] = []
        if outcome.thinking:
            content.append({"type": "thinking", "thinking": outcome.thinking, "signature": ""})
        if outcome.text:
            content.append({"type": "text", "text": outcome.text})
        for call in outcome.tool_calls:
            content.append({"type": "tool_use", "id": call.id, "name": call.name, "input": call_input(call)})
        return {
            "id": _message_id(),
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": content,
            **_stop(outcome.finish, outcome.stop_sequence),
            "usage": _usage(outcomes),
        }


def _message_id() -> str:
    return "msg_" + uuid.uuid4().hex[:24]


def _stop(finish: str, stop_sequence: str | None) -> dict[str, Any]:
    """Why the reply ended, Anthropic's way: a stop sequence is named."""
    if stop_sequence is not None:
        return {"stop_reason": "stop_sequence", "stop_sequence": stop_sequence}
    return {"stop_reason": STOP_REASONS.get(finish, "end_turn"), "stop_sequence": None}


def _usage(outcomes: list[Outcome]) -> dict[str, Any]:
    usage = Usage.of(outcomes)
    return {
        "input_tokens": usage.prompt,
        "output_tokens": usage.completion,
        "cache_read_input_tokens": usage.cached,
    }


def _event(kind: str, data: dict[str, Any]) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data})}\n\n"
