"""Ollama's API over the same model and worker.

`/api/chat` and `/api/generate` become an OpenAI chat (or, with `raw`, text) request, answered by
the same code as `/v1/`, its events encoded as Ollama's: one object, or NDJSON lines (Ollama
streams by default). Options map to llmcli's sampling settings; an option, field or content that
is not honoured is a 400 that says so (`images` for a text model or with `raw`, `num_ctx` over the
loaded context, `suffix`, `template`, `context`, any other field), never dropped. A message's
`images` (base64: server/images.py) come before its text, as Ollama puts them. `keep_alive` is
the named model's: unloaded that long after its last request ends (0: once this one ends;
negative: kept), as Ollama does; a request with neither `messages` nor `prompt` only loads (or,
with `keep_alive` 0, unloads) its model. `/api/tags` lists the models held and those a request
may load by name, `/api/ps` those held, with their state (server/fleet.py).
"""

from __future__ import annotations

import functools
import json
import math
import re
import time
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any, Literal

from fastapi import FastAPI, Request
from pydantic import Field

from llmcli.engine.reasoning import CONTENT, REASONING
from llmcli.errors import LlmcliError
from llmcli.server.answers import chat_response, completion_response
from llmcli.server.events import Encoder, Failed, Outcome, Piece, Usage, call_input
from llmcli.server.fleet import Fleet
from llmcli.server.images import from_base64, image_part
from llmcli.server.translate import Body, Part, read_body, validated

if TYPE_CHECKING:
    from llmcli.engine.tools import ToolCall
    from llmcli.server.state import Served
    from llmcli.server.worker import Job

# Ollama's option → the OpenAI field it becomes (and so the llmcli setting).
OPTIONS = {
    "temperature": "temperature",
    "top_k": "top_k",
    "top_p": "top_p",
    "min_p": "min_p",
    "num_predict": "max_tokens",
    "seed": "seed",
    "stop": "stop",
    "repeat_penalty": "repetition_penalty",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
}
UNIT_SECONDS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "μs": 1e-6, "ms": 1e-3, "s": 1, "m": 60, "h": 3600}
DURATION = re.compile(r"[-+]?(?:(?:\d+(?:\.\d*)?|\.\d+)(?:ns|us|µs|μs|ms|s|m|h))+")  # Go's time.ParseDuration
REFUSED_FIELDS = ("suffix", "template", "context")  # generate's: fill-in-the-middle, templates, old context


class OllamaError(LlmcliError):
    """A request Ollama's API cannot take here: a 400 in Ollama's error shape."""


class Options(Part):
    """The options read (OPTIONS and num_ctx), typed; any other is refused by name below."""

    num_ctx: int | None = Field(default=None, ge=1)
    num_predict: int | None = None
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: list[str] | None = None
    repeat_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None


class CalledFunction(Part):
    name: str
    arguments: dict[str, Any] | None = None


class Call(Part):
    function: CalledFunction


class Message(Body):
    role: Literal["system", "user", "assistant", "tool"]
    content: str | None = None
    images: list[str] | None = None
    tool_calls: list[Call] | None = None
    tool_name: str | None = None
    thinking: str | None = None  # an earlier turn's: not shown to the model again


class Common(Body):
    """The fields each route takes; any other is refused, never ignored."""

    model: str | None = None
    stream: bool | None = None
    format: str | dict[str, Any] | None = None  # "json" or a schema: said below
    options: Options | None = None
    think: bool | Literal["low", "medium", "high"] | None = None
    keep_alive: int | float | str | None = None


class ChatBody(Common):
    messages: list[Message] | None = None
    tools: list[dict[str, Any]] | None = None


class ShowBody(Body):
    model: str | None = None
    name: str | None = None  # older clients' name for model
    verbose: bool | None = None


class GenerateBody(Common):
    prompt: str | None = None
    system: str | None = None
    raw: bool | None = None
    images: list[str] | None = None
    suffix: str | None = None
    template: str | None = None
    context: list[int] | None = None


def install_ollama(app: FastAPI, fleet: Fleet) -> None:
    @app.get("/api/version")
    async def version() -> dict[str, Any]:
        from importlib.metadata import version as installed

        return {"version": installed("llmcli")}

    @app.get("/api/tags")
    async def tags() -> dict[str, Any]:
        return {"models": [_model_entry(entry) for entry in fleet.listing()]}

    @app.get("/api/ps")
    async def ps() -> dict[str, Any]:
        return {"models": [_running_entry(entry) for entry in fleet.states()]}

    @app.post("/api/show")
    async def show(request: Request) -> dict[str, Any]:
        body = await read_body(request, ShowBody, OllamaError)
        served = await fleet.serving(body.get("model") or body.get("name"))  # loaded, to describe it
        loaded = served.loaded
        return {
            "modelfile": "",
            "parameters": "",
            "template": str(getattr(loaded.tokenizer, "chat_template", "") or ""),
            "details": _details(served.model_id, loaded.quant),
            "model_info": {
                "llmcli.context_length": loaded.context_length,
                "llmcli.engine": served.engine.name,
            },
            "capabilities": ["completion", "tools", *(["vision"] if served.reads_images else [])],
        }

    @app.post("/api/chat")
    async def chat(request: Request) -> Any:
        body = await read_body(request, ChatBody, OllamaError)
        served = await _model(fleet, body)
        if body.get("messages") is None:
            return _loaded_only(served, body, chat=True)
        return await _answer(served, request, body, _chat_request(served, body), shape="chat")

    @app.post("/api/generate")
    async def generate(request: Request) -> Any:
        body = await read_body(request, GenerateBody, OllamaError)
        served = await _model(fleet, body)
        if body.get("prompt") is None and not body.get("images"):
            return _loaded_only(served, body, chat=False)
        return await _answer(served, request, body, _generate_request(served, body), shape="generate")


async def _model(fleet: Fleet, body: dict[str, Any]) -> Served:
    """The model the request names, loaded, with the request's keep_alive (checked first: a bad
    one loads nothing) as its own."""
    keep_alive = body.get("keep_alive")
    seconds = _seconds(keep_alive) if keep_alive is not None else None
    served = await fleet.serving(body.get("model"))
    if seconds is not None:
        fleet.keep_alive(served, seconds)
    return served


def _loaded_only(served: Served, body: dict[str, Any], chat: bool) -> dict[str, Any]:
    """Ollama's answer to a request that asks nothing: its model loaded, or with keep_alive 0
    unloaded (as the request ends)."""
    unloads = body.get("keep_alive") is not None and _seconds(body["keep_alive"]) == 0
    line: dict[str, Any] = {"model": served.model_id, "created_at": _now(), "done": True}
    line |= {"message": {"role": "assistant", "content": ""}} if chat else {"response": ""}
    return line | {"done_reason": "unload" if unloads else "load"}


def _seconds(keep_alive: float | str) -> float:
    """keep_alive as Ollama reads it: seconds, or a Go duration ("5m", "1h30m", "-1s": negative
    is for ever); anything else is refused, never taken for "keep it loaded"."""
    if not isinstance(keep_alive, str):
        if not math.isfinite(keep_alive):
            raise OllamaError(f'keep_alive {keep_alive} is not a duration: seconds, or e.g. "5m"')
        return float(keep_alive)
    if keep_alive in ("0", "+0", "-0"):
        return 0.0
    if not DURATION.fullmatch(keep_alive):
        raise OllamaError(f'keep_alive {keep_alive!r} is not a duration: seconds, or e.g. "5m", "1h30m"')
    pieces = re.findall(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|μs|ms|s|m|h)", keep_alive)
    seconds = sum(float(number) * UNIT_SECONDS[unit] for number, unit in pieces)
    return -seconds if keep_alive.startswith("-") else seconds


def _sampling(served: Served, body: dict[str, Any]) -> dict[str, Any]:
    """Ollama's options, format, think and stream as OpenAI fields."""
    fields: dict[str, Any] = {"stream": body.get("stream", True)}
    options = body.get("options") or {}
    if not isinstance(options, dict):
        raise OllamaError("options is an object")
    for name, value in options.items():
        if name == "num_ctx":
            if not isinstance(value, int) or value > served.loaded.context_length:
                raise OllamaError(
                    f"num_ctx {value} is over the loaded context of {served.loaded.context_length} tokens"
                )
            continue  # within the loaded context: that context serves it
        if name not in OPTIONS:
            known = ", ".join([*OPTIONS, "num_ctx"])
            raise OllamaError(f"option {name} is not supported here (these are: {known})")
        if name == "num_predict" and isinstance(value, int) and value < 0:
            continue  # -1 (-2): until the end of the context (_answer asks for it)
        fields[OPTIONS[name]] = value
    form = body.get("format")
    if form == "json":
        fields["response_format"] = {"type": "json_object"}
    elif isinstance(form, dict):
        fields["response_format"] = {"type": "json_schema", "json_schema": {"name": "format", "schema": form}}
    elif form not in (None, ""):
        raise OllamaError('format is "json" or a JSON schema')
    think = body.get("think")
    if think is False:
        fields["chat_template_kwargs"] = {"enable_thinking": False}
    elif isinstance(think, str):
        fields["reasoning_effort"] = think
    return fields


def _chat_request(served: Served, body: dict[str, Any]) -> dict[str, Any]:
    messages, calls_by_name = [], {}
    for position, message in enumerate(body.get("messages") or []):
        if not isinstance(message, dict):
            raise OllamaError(f"messages[{position}] is an object")
        content = _with_images(message.get("content") or "", message.get("images"), f"messages[{position}].")
        if not isinstance(content, str) and message.get("role") != "user":
            raise OllamaError(f"messages[{position}]: images are taken in user messages only")
        shaped: dict[str, Any] = {"role": message.get("role"), "content": content}
        if message.get("tool_calls"):
            shaped["tool_calls"] = []
            for number, call in enumerate(message["tool_calls"]):
                function = call.get("function") or {}
                call_id = f"call_{position}_{number}"
                calls_by_name[function.get("name")] = call_id
                arguments = json.dumps(function.get("arguments") or {})
                shaped["tool_calls"].append(
                    {"id": call_id, "function": {"name": function.get("name"), "arguments": arguments}}
                )
        if shaped["role"] == "tool":  # Ollama names the tool; OpenAI names the call
            shaped["tool_call_id"] = calls_by_name.get(message.get("tool_name")) or next(
                reversed(calls_by_name.values()), None
            )
        messages.append(shaped)
    request = {"messages": messages, **_sampling(served, body)}
    if body.get("tools"):
        request["tools"] = body["tools"]
    return request


def _generate_request(served: Served, body: dict[str, Any]) -> dict[str, Any]:
    for name in REFUSED_FIELDS:
        if body.get(name):
            raise OllamaError(f"{name} is not supported here")
    prompt = _with_images(body.get("prompt") or "", body.get("images"), "")
    if body.get("raw"):
        if body.get("system"):  # raw: no template to put a system prompt in
            raise OllamaError("system needs the chat template, and raw turns it off: send one of them")
        if not isinstance(prompt, str):  # raw: no template to put an image's tokens in
            raise OllamaError("images need the chat template, and raw turns it off: send one of them")
        return {"prompt": prompt, **_sampling(served, body)}
    messages = [{"role": "user", "content": prompt}]
    if body.get("system"):
        messages.insert(0, {"role": "system", "content": body["system"]})
    return {"messages": messages, **_sampling(served, body)}


def _with_images(text: str, images: list[str] | None, where: str) -> str | list[dict[str, Any]]:
    """A message's text, or its images then its text as neutral parts (server/images.py), each
    image named `{where}images[i]`."""
    if not images:
        return text
    parts = [image_part(from_base64(data, f"{where}images[{i}]", "images")) for i, data in enumerate(images)]
    return [*parts, {"type": "text", "text": text}] if text else parts


async def _answer(
    served: Served, request: Request, body: dict[str, Any], asked: dict[str, Any], shape: str
) -> Any:
    """Answer as an OpenAI chat (or, raw, text) request would be, encoded in `shape` ("chat": a
    `message`; "generate": a `response`): one object, or NDJSON lines."""
    from llmcli.server.protocol import ChatRequest, CompletionRequest

    parsed = validated(ChatRequest if "messages" in asked else CompletionRequest, asked, OllamaError)
    predict = (body.get("options") or {}).get("num_predict")
    # "no limit" as Ollama means it (up to the context), not the server's default
    to_context_end = isinstance(predict, int) and not isinstance(predict, bool) and predict < 0
    encoder_for = functools.partial(OllamaEncoder, served.model_id, shape == "chat")
    if isinstance(parsed, ChatRequest):
        return await chat_response(served, request, parsed, encoder_for, to_context_end=to_context_end)
    return await completion_response(served, request, parsed, encoder_for, to_context_end=to_context_end)


class OllamaEncoder(Encoder):
    """Ollama's answer: one object, or NDJSON lines (`done: false`), one per piece of text or
    thinking, then the done line with the whole calls, the reason and the durations."""

    media_type = "application/x-ndjson"

    def __init__(self, model: str, chat: bool, jobs: list[Job]) -> None:
        self.model, self.chat = model, chat  # the model that answered, as the server names it
        self.started = time.perf_counter()

    def piece(self, piece: Piece) -> str:
        channel, value = piece.channel, piece.value
        if channel not in (CONTENT, REASONING) or not value:
            return ""  # a call is sent whole, in the done line
        content, thinking = (value, None) if channel == CONTENT else ("", value)
        line: dict[str, Any] = {"model": self.model, "created_at": _now(), "done": False}
        if self.chat:
            line["message"] = {"role": "assistant", "content": content}
            if thinking:
                line["message"]["thinking"] = thinking
        else:
            line["response"] = content
            if thinking:
                line["thinking"] = thinking
        return json.dumps(line) + "\n"

    def closing(self, outcomes: list[Outcome]) -> str:
        last: dict[str, Any] = {"model": self.model, "created_at": _now(), "done": True}
        calls = outcomes[0].tool_calls
        if self.chat:
            last["message"] = {"role": "assistant", "content": ""}
            if calls:
                last["message"]["tool_calls"] = [_tool_call(call) for call in calls]
        else:
            last["response"] = ""
        return json.dumps(last | _done(outcomes, time.perf_counter() - self.started)) + "\n"

    def failed(self, failed: Failed) -> str:  # a cut reply: Ollama's error line, and no done line
        return json.dumps({"error": failed.message}) + "\n"

    def whole(self, outcomes: list[Outcome]) -> dict[str, Any]:
        outcome = outcomes[0]
        line: dict[str, Any] = {"model": self.model, "created_at": _now(), "done": True}
        if self.chat:
            line["message"] = {"role": "assistant", "content": outcome.text}
            if outcome.thinking:
                line["message"]["thinking"] = outcome.thinking
            if outcome.tool_calls:
                line["message"]["tool_calls"] = [_tool_call(call) for call in outcome.tool_calls]
        else:
            line["response"] = outcome.text
            if outcome.thinking:
                line["thinking"] = outcome.thinking
        return line | _done(outcomes)


def _tool_call(call: ToolCall) -> dict[str, Any]:
    """A call as Ollama gives it: its arguments an object, not JSON text."""
    return {"function": {"name": call.name, "arguments": call_input(call)}}


def _done(outcomes: list[Outcome], total_s: float | None = None) -> dict[str, Any]:
    """The done line's reason, counts and durations: the durations from the rates rounded as
    OpenAI's `timings` gives them, so that both APIs report the same figures."""
    prompt, completion = Usage.of(outcomes).counts
    stats = outcomes[0].stats
    decode, prefill = round(stats.decode_tok_s, 3), round(stats.prefill_tok_s, 3)
    eval_ns = int(completion / decode * 1e9) if decode else 0
    prompt_ns = int(prompt / prefill * 1e9) if prefill else 0
    return {
        "done_reason": "length" if outcomes[0].finish == "length" else "stop",
        "total_duration": int((total_s or 0) * 1e9) or prompt_ns + eval_ns,
        "load_duration": 0,
        "prompt_eval_count": prompt,
        "prompt_eval_duration": prompt_ns,
        "eval_count": completion,
        "eval_duration": eval_ns,
    }


def _model_entry(entry: dict[str, Any]) -> dict[str, Any]:
    """A model as /api/tags lists one (fleet.listing): its size in memory once loaded, else 0."""
    return {
        "name": entry["name"],
        "model": entry["name"],
        "modified_at": _now(),
        "size": entry.get("weight_bytes") or 0,
        "digest": "",
        "details": _details(entry["name"], entry.get("quant")),
        "state": entry["state"],
    }


def _running_entry(entry: dict[str, Any]) -> dict[str, Any]:
    """A model held, as /api/ps lists one: when its keep-alive unloads it (never: far ahead),
    its weights on a GPU, and llmcli's own state and idle time beside."""
    expires = entry.get("expires_at")
    on_gpu = str(entry.get("device")).startswith("cuda")
    return _model_entry(entry) | {
        "expires_at": _now(expires) if expires is not None else "9999-12-31T23:59:59Z",
        "size_vram": (entry.get("weight_bytes") or 0) if on_gpu else 0,
        "idle_s": entry.get("idle_s"),
    }


def _details(name: str, quant: str | None) -> dict[str, Any]:
    return {
        "format": "gguf" if name.endswith((".gguf", "Q4_1")) else "safetensors",
        "family": "",
        "families": None,
        "parameter_size": "",
        "quantization_level": quant or "",
    }


def _now(at: float | None = None) -> str:
    moment = datetime.fromtimestamp(at, timezone.utc) if at is not None else datetime.now(timezone.utc)
    return moment.isoformat().replace("+00:00", "Z")
