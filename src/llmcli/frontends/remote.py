"""The remote target: a running `llmcli serve` found by itself, or any OpenAI-compatible endpoint
named with --server. Nothing here imports torch or transformers: that is the point of a warm
server.

What only an in-process model gives degrades, and says so: a chat is kept as messages and
re-sent whole each turn (llmcli's server prefills only what its cache does not hold; its exact
token ids are the server's business, so /undo crops no cache here), and another kind of server
reports only its `usage`, not llmcli's timings, drafts or the sampling values it used.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from llmcli.config.settings import (
    SAMPLING_NUMBERS,
    LoadSettings,
    RemoteSettings,
    SamplingSettings,
    SpeculativeSettings,
)
from llmcli.engine.reasoning import CONTENT, REASONING
from llmcli.engine.tools import CHOICES, ToolCall
from llmcli.errors import UsageError
from llmcli.frontends import terminal
from llmcli.frontends.target import Ask, Outcome
from llmcli.reading import peer_text
from llmcli.server.client import OPENAI_NAMES, Client, StreamBrokenError

if TYPE_CHECKING:
    from llmcli.engine.structured import OutputFormat
    from llmcli.engine.tools import ToolRequest
    from llmcli.server.runtime import ServerRecord

# What --json reports about how the model is loaded, as llmcli's /health gives it.
LOAD_FACTS = (
    "weight_bytes",
    "device",
    "dtype",
    "quant",
    "quant_backend",
    "cpu_kernels",
    "engine",
    "kv_bytes_per_token",
    "context_length",
)
# The most tokens a reply through a server may have when neither -n nor the server's context
# bounds it: far above any model's longest reply, so that only a stream that never ends meets it.
REPLY_TOKENS_CEILING = 2**18


def most_pieces(max_tokens: int | None, context_length: int) -> int:
    """How many pieces of a streamed reply (text, thinking, call parts) are read at most. A server
    may ignore max_tokens, so the client counts too: every piece is at least one token, and the
    margin is for a server that sends one token in two pieces (where thinking turns to text)."""
    limit = max_tokens or context_length or REPLY_TOKENS_CEILING
    return limit + limit // 4 + 16


def find_server(
    model: str | None,
    load: LoadSettings,
    remote: RemoteSettings,
    in_process: bool,
    speculative: SpeculativeSettings | None = None,
) -> RemoteTarget | None:
    """The server to use, or None to load in-process. An explicit URL must answer; a discovered
    one that does not (hung, or gone since it wrote its record) is passed over quietly, and so
    is one without the draft model asked for."""
    if remote.no_server or in_process:
        return None
    if remote.server:
        client = Client(remote.server, remote.api_key)
        info = client.llmcli_health(timeout_s=5.0)
        name = model or (info["model"] if info else client.first_model())
        return RemoteTarget(client, name, info)
    from llmcli.models.default_model import default_model_spec
    from llmcli.server.runtime import matching_server, name_on, near_miss

    spec = model or default_model_spec()
    record = matching_server(spec, load, note=terminal.note)
    if record is not None:
        record = _loaded(record, spec)
    if record is None:
        missed = near_miss(spec, load)
        if missed is not None:  # said once, so that a slow load here is not a mystery
            terminal.note(
                f"The server at {peer_text(missed[0].url)} runs this model with other settings: "
                f"{missed[1]}. Loading it here (--no-server skips the check)."
            )
        return None
    if not _drafts_as_asked(record, speculative):
        return None
    if not record.loopback:
        return None  # a server on another address is used only when named with --server
    if record.needs_key and not remote.api_key:
        terminal.note(
            f"The server at {record.url} runs this model but needs its key: set LLMCLI_API_KEY "
            "(or --api-key) to use it. Loading the model here (--no-server skips the check)."
        )
        return None
    client = Client(record.url, remote.api_key)
    info = client.llmcli_health(timeout_s=1.0)
    # The URL answers for this very record's server: not another program that took the port.
    if not info or info.get("instance") != record.instance:
        return None
    return RemoteTarget(client, name_on(record, spec) if record.models else info["model"], info)


# How long a call waits for a server of its model that is still loading, rather than loading
# the same model a second time beside it.
LOADING_PATIENCE_S = 300.0


def _loaded(record: ServerRecord, spec: str) -> ServerRecord | None:
    """`record` once its server has loaded; None if it stopped, or is not done in time."""
    from llmcli.server.process_check import is_running
    from llmcli.server.runtime import READY, BadRecord, read_record

    if record.state == READY:
        return record
    terminal.note(f"Waiting for the server of {spec} that is still loading (pid {record.pid}).")
    deadline = time.monotonic() + LOADING_PATIENCE_S
    while time.monotonic() < deadline:
        time.sleep(0.05)
        try:
            record = read_record(record.path)
        except (OSError, BadRecord):
            return None  # it stopped (or gave up): this call loads in-process
        if not is_running(record.process):
            return None
        if record.state == READY:
            return record
    terminal.note(f"It is still loading after {LOADING_PATIENCE_S:g} s: loading the model here.")
    return None


def _drafts_as_asked(record: ServerRecord, speculative: SpeculativeSettings | None) -> bool:
    """Lookup is asked per request; drafting with a model needs the server to hold that model,
    and with the MTP head a server started with it (its record says so as its draft model)."""
    if speculative is None or speculative.method not in ("draft", "mtp"):
        return True
    from llmcli.server.runtime import MTP_DRAFTER

    asked = MTP_DRAFTER if speculative.method == "mtp" else speculative.draft_model
    return record.draft_model == asked


class RemoteTarget:
    def __init__(self, client: Client, model: str, info: dict[str, Any] | None) -> None:
        self.client = client
        self.model_id = model  # the name to send
        self.name = peer_text(model)  # the name to show: a server's name may carry escape sequences
        self.info = info  # llmcli's /health; None for another kind of server
        self.where = client.url
        info = info or {}
        self.dtype_name = peer_text(str(info.get("dtype") or "remote"))
        self.context_length = _count(info.get("context_length")) or 0
        self.engine_name = peer_text(str(info.get("engine") or "remote"))

    @property
    def is_llmcli(self) -> bool:
        return self.info is not None

    def image_refusal(self) -> str | None:
        return None  # the server says, in its protocol's 400, when the image reaches it

    @property
    def caveat(self) -> str | None:
        if self.is_llmcli:
            return None
        return (
            f"{self.client.url} is not an llmcli server: timings are its usage counts only, "
            "and /undo re-sends the chat rather than cropping a cache."
        )

    def facts(self) -> dict[str, Any]:
        info = self.info or {}
        return {**{name: info.get(name) for name in LOAD_FACTS}, "server": self.client.url}

    def summary(self) -> str:
        return f"server {self.client.url}"

    def shown_sampling(self, sampling: SamplingSettings) -> dict[str, Any]:
        """Only the values given here are sent; the rest are the server's."""
        return {name: value for name, value in vars(sampling).items() if value not in (None, ())}

    def speculation(self, method: str) -> None:
        # An llmcli server takes the method per request (and refuses draft without a draft model).
        if not self.is_llmcli:
            raise UsageError(f"{self.client.url} is not an llmcli server: it drafts as it was started")

    def reply(self, ask: Ask) -> RemoteReply:
        if ask.think_budget is not None:
            raise UsageError("a thinking budget runs in-process only: the OpenAI API has no field for it")
        if ask.speculative != "off":
            self.speculation(ask.speculative)  # another kind of server drafts as it was started
        body = self.request_body(ask.sampling, ask.speculative, ask.output)
        most = most_pieces(ask.sampling.max_new_tokens, self.context_length)
        if ask.raw:
            body["prompt"] = "\n\n".join(m["content"] for m in ask.messages)
            return RemoteReply(self.client, "completions", body, ask.output, most)
        body["messages"] = [openai_message(message) for message in ask.messages]
        if ask.think_off:  # as vLLM and llmcli's server read it
            body["chat_template_kwargs"] = {"enable_thinking": False}
        if ask.tools is not None:
            body |= tools_fields(ask.tools)
        return RemoteReply(self.client, "chat/completions", body, ask.output, most)

    def request_body(
        self, sampling: SamplingSettings, speculative: str | None, output: OutputFormat | None
    ) -> dict[str, Any]:
        fields = {OPENAI_NAMES.get(name, name): getattr(sampling, name) for name in SAMPLING_NUMBERS}
        fields["stop"] = list(sampling.stop) or None
        body = {name: value for name, value in fields.items() if value is not None}
        if speculative is not None and self.is_llmcli:
            # llmcli's own extra field, sent only to an llmcli server (others would not know it).
            body["speculative"] = speculative
        if output is not None:
            body["response_format"] = response_format(output)
        return {"model": self.model_id, **body, "stream_options": {"include_usage": True}}

    def chat(self, system: str | None) -> RemoteHistory:
        return RemoteHistory(self, system)


def response_format(output: OutputFormat) -> dict[str, Any]:
    """OpenAI's response_format for a constrained reply (any server that speaks it)."""
    from llmcli.engine.structured import ANY_OBJECT

    if output.schema == ANY_OBJECT:
        return {"type": "json_object"}
    return {"type": "json_schema", "json_schema": {"name": "llmcli", "schema": output.schema, "strict": True}}


def sendable(message: dict[str, Any]) -> dict[str, Any]:
    """A kept message as OpenAI's API takes it: our own keys ("interrupted") stay here."""
    return {key: message[key] for key in ("role", "content", "tool_calls", "tool_call_id") if key in message}


def tools_fields(tools: ToolRequest) -> dict[str, Any]:
    """OpenAI's tools, tool_choice and parallel_tool_calls for a request."""
    choice: Any = tools.choice
    if choice not in CHOICES:
        choice = {"type": "function", "function": {"name": choice}}
    return {
        "tools": [tool.openai() for tool in tools.tools],
        "tool_choice": choice,
        "parallel_tool_calls": tools.parallel,
    }


class RemoteReply:
    """A streamed reply; leaving the stream early is a disconnect, and the server stops. What the
    server sends is checked as it comes: a piece that is not text is a broken reply, and one
    more piece than `most` ends it as cut by the length, however long the server goes on."""

    def __init__(
        self, client: Client, endpoint: str, body: dict[str, Any], output: OutputFormat | None, most: int
    ) -> None:
        self._url = client.url
        self._events = client.stream(endpoint, body)
        self._chat = endpoint == "chat/completions"
        self._output = output
        self._most = most
        self._read = 0  # pieces read: each is at least one token
        self._pieces: list[str] = []
        self._thinking: list[str] = []  # delta.reasoning_content, as llmcli, vLLM and llama.cpp send it
        self._calls: dict[int, dict[str, str]] = {}  # delta.tool_calls by index: id, name, arguments
        self._finish = "stop"
        self._usage: dict[str, Any] = {}
        self._timings: dict[str, Any] = {}
        self._sampling: dict[str, Any] | None = None
        self._started = time.perf_counter()
        self._first_at: float | None = None

    def __iter__(self) -> Iterator[tuple[str, str]]:
        try:
            for event in self._events:
                for choice in self._items(event.get("choices")):
                    yield from self._take_choice(choice)
                    if self._read > self._most:  # the server went on past the limit: stop reading
                        self._finish = "length"
                        return
                self._usage = self._mapping(event.get("usage")) or self._usage
                self._timings = self._mapping(event.get("timings")) or self._timings
                self._sampling = self._mapping(event.get("sampling")) or self._sampling
        except StreamBrokenError:
            self._finish = "error"  # what came is kept; the caller says what happened
            raise
        finally:
            self._events.close()  # a stream left early is a disconnect: the server stops generating

    def _take_choice(self, choice: dict[str, Any]) -> Iterator[tuple[str, str]]:
        delta = self._mapping(choice.get("delta"))
        thought = self._text(delta.get("reasoning_content")) if self._chat else ""
        if thought:
            self._first_at = self._first_at or time.perf_counter()
            self._read += 1
            self._thinking.append(thought)
            yield REASONING, thought
        for part in self._items(delta.get("tool_calls")) if self._chat else ():
            self._read += 1
            self._take_call_part(part)
        piece = self._text(delta.get("content") if self._chat else choice.get("text"))
        if piece:
            self._first_at = self._first_at or time.perf_counter()
            self._read += 1
            self._pieces.append(piece)
            yield CONTENT, piece
        finish = self._text(choice.get("finish_reason"))
        self._finish = peer_text(finish) if finish else self._finish

    def _take_call_part(self, part: dict[str, Any]) -> None:
        """A streamed call: its id and name first, then its arguments in pieces (OpenAI's shape)."""
        index = part.get("index", 0)
        if not isinstance(index, int) or isinstance(index, bool):
            raise self._malformed("a tool call's index")
        call = self._calls.setdefault(index, {"id": "", "name": "", "arguments": ""})
        function = self._mapping(part.get("function"))
        call["id"] = self._text(part.get("id")) or call["id"]
        call["name"] = self._text(function.get("name")) or call["name"]
        call["arguments"] += self._text(function.get("arguments"))

    def _text(self, value: Any) -> str:
        if value is None or isinstance(value, str):
            return value or ""
        raise self._malformed("a piece of text")

    def _mapping(self, value: Any) -> dict[str, Any]:
        if value is None or isinstance(value, dict):
            return value or {}
        raise self._malformed("an object")

    def _items(self, value: Any) -> list[dict[str, Any]]:
        if value is None or (isinstance(value, list) and all(isinstance(item, dict) for item in value)):
            return value or []
        raise self._malformed("a list of objects")

    def _malformed(self, what: str) -> StreamBrokenError:
        return StreamBrokenError(f"{self._url} sent a chunk not in OpenAI's shape: where {what} goes")

    def interrupt(self) -> None:
        self._finish = "interrupted"
        self._events.close()

    def outcome(self) -> Outcome:
        import json

        text, usage, timings = "".join(self._pieces), self._usage, self._timings
        prompt_tokens = _count(usage.get("prompt_tokens"))
        cached = _count(_in(usage, "prompt_tokens_details", "cached_tokens"))
        prefilled = _count(timings.get("prefilled_tokens"))
        completion_tokens = _count(usage.get("completion_tokens"))
        if completion_tokens is None and self._pieces:  # no usage (another server, a reply cut)
            completion_tokens = len(self._pieces)
        if prefilled is None and prompt_tokens is not None:
            prefilled = prompt_tokens - (cached or 0)
        complete = None
        if self._output is not None:
            try:
                json.loads(text)
                complete = True
            except ValueError:
                complete = False
        return Outcome(
            text=text,
            finish_reason=self._finish,
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            prefilled_tokens=prefilled,
            cached_tokens=cached,
            cached_from=source if isinstance(source := timings.get("cached_from"), str) else None,
            ttft_s=_seconds(timings.get("ttft_s"), (self._first_at or self._started) - self._started),
            prefill_tok_s=_seconds(timings.get("prefill_tok_s")),
            decode_tok_s=_seconds(timings.get("decode_tok_s")),
            speculative=_speculative(timings.get("speculative")),
            sampling=_sampling(self._sampling),
            value_complete=complete,
            reasoning="".join(self._thinking) if self._thinking else None,
            reasoning_tokens=_count(_in(usage, "completion_tokens_details", "reasoning_tokens")),
            tool_calls=[
                ToolCall(call["id"], call["name"], call["arguments"] or "{}")
                for _, call in sorted(self._calls.items())
            ],
        )


def _count(value: Any) -> int | None:
    """A token count a server reported, or None where it is not one."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def _seconds(value: Any, default: float | None = None) -> float | None:
    """A time or a rate a server reported (a finite number ≥ 0), else `default`."""
    number = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    return float(value) if number and value >= 0 else default


def _in(record: dict[str, Any], key: str, inner: str) -> Any:
    value = record.get(key)
    return value.get(inner) if isinstance(value, dict) else None


def _speculative(value: Any) -> dict[str, Any] | None:
    """llmcli's drafting figures, when whole: the --stats line divides them."""
    if not isinstance(value, dict) or not isinstance(value.get("method"), str):
        return None
    drafted, accepted = _count(value.get("drafted")), _count(value.get("accepted"))
    if drafted is None or accepted is None:
        return None
    return {"method": peer_text(value["method"], 40), "drafted": drafted, "accepted": accepted}


def _sampling(value: dict[str, Any] | None) -> dict[str, Any] | None:
    """The sampling values llmcli's server used (shown in --json); a limit a message quotes is a count."""
    if value is None or "max_new_tokens" not in value:
        return value
    return {**value, "max_new_tokens": _count(value["max_new_tokens"])}


class RemoteHistory:
    """A chat through a server: messages kept here and re-sent whole each turn."""

    def __init__(self, target: RemoteTarget, system: str | None) -> None:
        self.target = target
        self.system = system
        self.messages: list[dict[str, Any]] = []
        self.think_off = False  # sent as chat_template_kwargs
        self.think_budget: int | None = None  # refused: the OpenAI API has no field for it
        self._pending: str | list[dict[str, Any]] | None = None
        self._steps: list[dict[str, Any]] = []  # this turn's tool calls and results so far
        self.tools: ToolRequest | None = None  # sent with each request (ask's choice of them)
        self._last_used = 0

    @property
    def context_used(self) -> int:
        return self._last_used

    pending_tokens = 0  # counted by the server

    def prepare(
        self,
        user_text: str | list[dict[str, Any]],
        sampling: SamplingSettings,
        steps: list[dict[str, Any]] | None = None,
    ) -> int:
        self._pending, self._steps = user_text, list(steps or [])
        return 0  # the server fits the conversation to its context, or refuses it

    def ask(
        self,
        sampling: SamplingSettings,
        speculative: str,
        output: OutputFormat | None,
        tools: ToolRequest | None = None,
    ) -> RemoteReply:
        assert self._pending is not None
        system = [{"role": "system", "content": self.system}] if self.system else []
        sent = [sendable(m) for m in self.messages]
        messages = [*system, *sent, {"role": "user", "content": self._pending}, *self._steps]
        ask = Ask(
            messages,
            sampling,
            speculative,
            output,
            think_off=self.think_off,
            think_budget=self.think_budget,
            tools=tools,
        )
        return self.target.reply(ask)

    def step(self, outcome: Outcome) -> None:
        """A reply that called tools: the server keeps its own cache; nothing to do here."""

    def commit(self, outcome: Outcome, steps: list[dict[str, Any]] | None = None) -> None:
        assert self._pending is not None
        assistant: dict[str, Any] = {"role": "assistant", "content": outcome.text}
        if outcome.finish_reason in ("interrupted", "error"):
            assistant["interrupted"] = True
        self.messages += [{"role": "user", "content": self._pending}, *(steps or []), assistant]
        self._pending, self._steps = None, []
        self._last_used = (outcome.prompt_tokens or 0) + (outcome.completion_tokens or 0)

    def abandon(self, error: Exception) -> str | None:
        self._pending = None
        return None  # nothing of the server's to put right here

    def set_system(self, text: str | None) -> None:
        self.system = text or None

    def undo(self, keep_cache: bool = False) -> tuple[str, str] | None:
        from llmcli.engine.conversation import exchange_starts

        starts = exchange_starts(self.messages)
        if not starts or starts[-1] == len(self.messages) - 1:
            return None
        user, reply = self.messages[starts[-1]]["content"], self.messages[-1]["content"]
        del self.messages[starts[-1] :]
        return user, reply

    def restore(self, user: str, reply: str) -> None:
        self.messages += [{"role": "user", "content": user}, {"role": "assistant", "content": reply}]

    def reset(self) -> None:
        self.messages = []

    def replace(
        self, system: str | None, messages: list[dict[str, Any]], room: SamplingSettings, where: str
    ) -> str:
        self.system, self.messages = system, [dict(m) for m in messages]
        return ""

    def describe(self) -> str:
        from llmcli.frontends.wording import plural

        context = self.target.context_length or "unknown"
        from llmcli.engine.conversation import exchange_starts

        exchanges = len(exchange_starts(self.messages))
        return f"{plural(exchanges, 'exchange')} · context {context} tokens"


def openai_message(message: dict[str, Any]) -> dict[str, Any]:
    """A message as OpenAI's API carries it: an image part (its bytes, here) as an `image_url`
    part holding a data URL, which a server reads without fetching anything."""
    content = message.get("content")
    if not isinstance(content, list):
        return message
    parts = [_openai_part(part) for part in content]
    return {**message, "content": parts}


def _openai_part(part: dict[str, Any]) -> dict[str, Any]:
    if part.get("type") != "image":
        return part
    import base64

    data = part["image"].data
    url = f"data:{_media_type(data)};base64,{base64.b64encode(data).decode('ascii')}"
    return {"type": "image_url", "image_url": {"url": url}}


def _media_type(data: bytes) -> str:
    """The image's type from its first bytes (the server checks the bytes themselves)."""
    for start, kind in ((b"\x89PNG", "png"), (b"\xff\xd8", "jpeg"), (b"GIF8", "gif"), (b"BM", "bmp")):
        if data.startswith(start):
            return f"image/{kind}"
    return "image/webp" if data[8:12] == b"WEBP" else "image/png"
