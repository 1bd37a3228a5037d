"""Ollama's API over the same model and worker: translation only.

`/api/chat` and `/api/generate` become an OpenAI chat (or, with `raw`, text) request, answered by
the same code as `/v1/`, and the answer is translated back: one object, or NDJSON lines (Ollama
streams by default). Options map to llmcli's sampling settings; an option, field or content that
is not honoured is a 400 that says so (`images` for a text model, `num_ctx` over the loaded
context, `suffix`, `template`, `context`, any other field), never dropped. `keep_alive` is
accepted (the model stays loaded for the server's life), except 0, which would unload it.
`/api/tags`, `/api/show`, `/api/ps` and `/api/version` describe the one loaded model.
"""

from __future__ import annotations

import json
import math
import re
import time
from collections.abc import AsyncIterator
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any, Literal

from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse
from pydantic import Field

from llmcli.errors import LlmcliError
from llmcli.server import openai
from llmcli.server.answers import chat_response, completion_response
from llmcli.server.translate import Body, Part, chunk_of, events_of, read_body, validated

if TYPE_CHECKING:
    from llmcli.server.state import Served

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


def install_ollama(app: FastAPI, served: Served) -> None:
    @app.get("/api/version")
    async def version() -> dict[str, Any]:
        from importlib.metadata import version as installed

        return {"version": installed("llmcli")}

    @app.get("/api/tags")
    async def tags() -> dict[str, Any]:
        return {"models": [_model_entry(served)]}

    @app.get("/api/ps")
    async def ps() -> dict[str, Any]:
        entry = _model_entry(served) | {"expires_at": "9999-12-31T23:59:59Z", "size_vram": _vram(served)}
        return {"models": [entry]}

    @app.post("/api/show")
    async def show(request: Request) -> dict[str, Any]:
        await read_body(request, ShowBody, OllamaError)  # one model here, whichever it names
        loaded = served.loaded
        return {
            "modelfile": "",
            "parameters": "",
            "template": str(getattr(loaded.tokenizer, "chat_template", "") or ""),
            "details": _details(served),
            "model_info": {
                "llmcli.context_length": loaded.context_length,
                "llmcli.engine": served.engine.name,
            },
            "capabilities": ["completion", "tools"],
        }

    @app.post("/api/chat")
    async def chat(request: Request) -> Any:
        body = _checked(await read_body(request, ChatBody, OllamaError))
        return await _answer(served, request, body, _chat_request(served, body), shape="chat")

    @app.post("/api/generate")
    async def generate(request: Request) -> Any:
        body = _checked(await read_body(request, GenerateBody, OllamaError))
        return await _answer(served, request, body, _generate_request(served, body), shape="generate")


def _checked(body: dict[str, Any]) -> dict[str, Any]:
    keep_alive = body.get("keep_alive")
    if keep_alive is not None and _seconds(keep_alive) == 0:  # unload now: never done here
        raise OllamaError("keep_alive 0 would unload the model: llmcli serve keeps it loaded while it runs")
    return body


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
    fields: dict[str, Any] = {"stream": body.get("stream", True), "stream_options": {"include_usage": True}}
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
        if message.get("images"):
            raise OllamaError("this server's model reads text only: images are not supported")
        shaped: dict[str, Any] = {"role": message.get("role"), "content": message.get("content") or ""}
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
    if body.get("images"):
        raise OllamaError("this server's model reads text only: images are not supported")
    prompt = body.get("prompt") or ""
    if body.get("raw"):
        if body.get("system"):  # raw: no template to put a system prompt in
            raise OllamaError("system needs the chat template, and raw turns it off: send one of them")
        return {"prompt": prompt, **_sampling(served, body)}
    messages = [{"role": "user", "content": prompt}]
    if body.get("system"):
        messages.insert(0, {"role": "system", "content": body["system"]})
    return {"messages": messages, **_sampling(served, body)}


async def _answer(
    served: Served, request: Request, body: dict[str, Any], asked: dict[str, Any], shape: str
) -> Any:
    """Answer through the OpenAI path, then translate to `shape` ("chat": a `message`;
    "generate": a `response`): one object, or NDJSON lines."""
    from llmcli.server.protocol import ChatRequest, CompletionRequest

    parsed = validated(ChatRequest if "messages" in asked else CompletionRequest, asked, OllamaError)
    predict = (body.get("options") or {}).get("num_predict")
    # "no limit" as Ollama means it (up to the context), not the server's default
    to_context_end = isinstance(predict, int) and not isinstance(predict, bool) and predict < 0
    if isinstance(parsed, ChatRequest):
        encoder_for = openai.chat_encoder(served, True)
        answered = await chat_response(served, request, parsed, encoder_for, to_context_end=to_context_end)
    else:
        encoder_for = openai.completion_encoder(served, True)
        answered = await completion_response(
            served, request, parsed, encoder_for, to_context_end=to_context_end
        )
    model = served.model_id  # the model that answered, as the OpenAI route names it
    if isinstance(answered, StreamingResponse):
        lines = _lines(events_of(answered.body_iterator), model, shape == "chat", time.perf_counter())
        return StreamingResponse(lines, media_type="application/x-ndjson")
    return _whole(answered, model, shape == "chat")


def _whole(answer: dict[str, Any], model: str, chat: bool) -> dict[str, Any]:
    choice = answer["choices"][0]
    message = choice.get("message") or {"content": choice.get("text", "")}
    line: dict[str, Any] = {"model": model, "created_at": _now(), "done": True}
    if chat:
        line["message"] = {"role": "assistant", "content": message.get("content") or ""}
        if message.get("reasoning_content"):
            line["message"]["thinking"] = message["reasoning_content"]
        if message.get("tool_calls"):
            line["message"]["tool_calls"] = [_tool_call(call) for call in message["tool_calls"]]
    else:
        line["response"] = message.get("content") or ""
        if message.get("reasoning_content"):
            line["thinking"] = message["reasoning_content"]
    return line | _done(choice["finish_reason"], answer.get("usage") or {}, answer.get("timings") or {})


async def _lines(events: AsyncIterator[Any], model: str, chat: bool, started: float) -> AsyncIterator[str]:
    """OpenAI's server-sent events, as Ollama's NDJSON lines."""
    finish, timings, calls = "stop", {}, []
    async for event in events:
        chunk = chunk_of(event)
        if chunk is None:
            continue
        if "error" in chunk:  # a cut reply: Ollama's error line, and no done line
            yield json.dumps({"error": chunk["error"]["message"]}) + "\n"
            return
        for choice in chunk.get("choices") or ():
            finish = choice.get("finish_reason") or finish
            delta = choice.get("delta") or {"content": choice.get("text") or ""}
            calls += list(delta.get("tool_calls") or ())
            content, thinking = delta.get("content") or "", delta.get("reasoning_content")
            if not content and not thinking:
                continue
            line: dict[str, Any] = {"model": model, "created_at": _now(), "done": False}
            if chat:
                line["message"] = {"role": "assistant", "content": content}
                if thinking:
                    line["message"]["thinking"] = thinking
            else:
                line["response"] = content
                if thinking:
                    line["thinking"] = thinking
            yield json.dumps(line) + "\n"
        timings = chunk.get("timings") or timings
        if chunk.get("usage"):
            last: dict[str, Any] = {"model": model, "created_at": _now(), "done": True}
            if chat:
                last["message"] = {"role": "assistant", "content": ""}
                if calls:
                    last["message"]["tool_calls"] = [_tool_call(call) for call in _joined(calls)]
            else:
                last["response"] = ""
            yield (
                json.dumps(last | _done(finish, chunk["usage"], timings, time.perf_counter() - started))
                + "\n"
            )


def _joined(parts: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Streamed call parts (id and name, then argument pieces) as whole calls."""
    calls: dict[int, dict[str, Any]] = {}
    for part in parts:
        call = calls.setdefault(part.get("index", 0), {"function": {"name": "", "arguments": ""}})
        function = part.get("function") or {}
        call["function"]["name"] = function.get("name") or call["function"]["name"]
        call["function"]["arguments"] += function.get("arguments") or ""
    return [calls[index] for index in sorted(calls)]


def _tool_call(call: dict[str, Any]) -> dict[str, Any]:
    """OpenAI's call (arguments as JSON text) as Ollama's (arguments as an object)."""
    function = call["function"]
    return {"function": {"name": function["name"], "arguments": json.loads(function["arguments"] or "{}")}}


def _done(
    finish: str, usage: dict[str, Any], timings: dict[str, Any], total_s: float | None = None
) -> dict[str, Any]:
    prompt, completion = usage.get("prompt_tokens", 0), usage.get("completion_tokens", 0)
    decode = timings.get("decode_tok_s") or 0
    prefill = timings.get("prefill_tok_s") or 0
    eval_ns = int(completion / decode * 1e9) if decode else 0
    prompt_ns = int(prompt / prefill * 1e9) if prefill else 0
    return {
        "done_reason": "length" if finish == "length" else "stop",
        "total_duration": int((total_s or 0) * 1e9) or prompt_ns + eval_ns,
        "load_duration": 0,
        "prompt_eval_count": prompt,
        "prompt_eval_duration": prompt_ns,
        "eval_count": completion,
        "eval_duration": eval_ns,
    }


def _model_entry(served: Served) -> dict[str, Any]:
    return {
        "name": served.model_id,
        "model": served.model_id,
        "modified_at": _now(),
        "size": served.loaded.weight_bytes,
        "digest": "",
        "details": _details(served),
    }


def _details(served: Served) -> dict[str, Any]:
    loaded = served.loaded
    return {
        "format": "gguf" if str(served.model_id).endswith((".gguf", "Q4_1")) else "safetensors",
        "family": "",
        "families": None,
        "parameter_size": "",
        "quantization_level": loaded.quant,
    }


def _vram(served: Served) -> int:
    return served.loaded.weight_bytes if str(served.loaded.device).startswith("cuda") else 0


def _now() -> str:
    return datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")
