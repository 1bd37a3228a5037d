"""The OpenAI request bodies llmcli accepts, and its error objects.

A field not declared here is a 400 that names it (`audio`, `modalities` beyond text,
`web_search_options`, a typo), never ignored; those that change nothing for a served model
(`user`, `metadata`, …) are declared. Known fields of the wrong type or out of range are a 400
naming the field. llmcli's own sampling controls (top_k, min_p, repetition_penalty) ride along as
extra fields, as vLLM and llama.cpp's server accept them. Inside a message, fields a client echoes
back from an earlier reply (`refusal`, `annotations`, …) are ignored: they are not instructions.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    InstanceOf,
    create_model,
    field_validator,
    model_validator,
)

from llmcli.config.declare import declarations, field_types
from llmcli.config.settings import SAMPLING_NUMBERS, SamplingSettings
from llmcli.errors import UsageError
from llmcli.server.client import OPENAI_NAMES
from llmcli.server.images import ImageRef, from_url, image_part, refuse_detail

if TYPE_CHECKING:
    from llmcli.engine.structured import OutputFormat
    from llmcli.engine.tools import ToolRequest


class StreamOptions(BaseModel):
    include_usage: bool = False


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | bool = Field(default=True, alias="schema")
    strict: bool | None = None  # always strict here: the grammar allows nothing else


class ResponseFormat(BaseModel):
    """OpenAI's response_format: text, any JSON object, or JSON valid under a schema."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    def output(self) -> OutputFormat | None:
        """The constraint asked for; an invalid or unsatisfiable schema raises UsageError."""
        from llmcli.engine.structured import ANY_OBJECT, OutputFormat, parse_schema
        from llmcli.engine.structured.grammar import check_format

        if self.type == "text":
            return None
        if self.type == "json_object":
            output = OutputFormat(ANY_OBJECT, "response_format json_object")
        else:
            if self.json_schema is None:
                raise UsageError("response_format json_schema needs a json_schema object with a schema")
            name = self.json_schema.name or "json_schema"
            schema = parse_schema(self.json_schema.schema_, f"response_format {name}")
            output = OutputFormat(schema, f"response_format {name}")
        check_format(output)
        return output


def _sampling_fields() -> dict[str, Any]:
    """One optional request field per numeric sampling setting, under its OpenAI name, with the
    type and bounds its declaration gives (config/settings.py): a new sampling setting is a new
    request field by itself. max_completion_tokens is OpenAI's newer name for max_tokens."""
    types = field_types(SamplingSettings)
    fields: dict[str, Any] = {}
    for name in SAMPLING_NUMBERS:
        bounds = declarations(SamplingSettings)[name].bounds
        field = (types[name] | None, Field(default=None, **(bounds.pydantic() if bounds else {})))
        fields[OPENAI_NAMES.get(name, name)] = field
    fields["max_completion_tokens"] = fields[OPENAI_NAMES["max_new_tokens"]]
    return fields


_SamplingFields: type[BaseModel] = create_model(  # type: ignore[call-overload]
    "_SamplingFields", __config__=ConfigDict(extra="forbid"), **_sampling_fields()
)


class _Sampling(_SamplingFields):  # type: ignore[misc,valid-type]
    model: str | None = None
    stop: str | list[str] | None = None
    n: int = Field(default=1, ge=1, le=16)  # choices, generated at once where the server runs several
    speculative: Literal["off", "lookup", "draft", "mtp"] | None = None  # llmcli's: default, the server's
    response_format: ResponseFormat | None = None
    logit_bias: dict[str, float] | None = None  # token id (as text) → added to its logit, -100…100
    stream: bool = False
    stream_options: StreamOptions | None = None
    modalities: list[Literal["text"]] | None = None  # audio out is not generated here
    # What a client may send that changes nothing for a served model: taken, not acted on.
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None  # a hint: the slot whose cache last served the key (Slots)
    metadata: dict[str, str] | None = None
    service_tier: str | None = None

    @model_validator(mode="after")
    def _text_only(self) -> _Sampling:
        """A lone UTF-16 surrogate (valid JSON, "\\ud800") is not text: no tokenizer takes it."""
        try:
            # An image's bytes are not text: they are left out (`default`).
            json.dumps(self.model_dump(), ensure_ascii=False, default=lambda _: None).encode("utf-8")
        except UnicodeEncodeError as error:
            bad = error.object[error.start : error.end].encode("unicode_escape").decode()
            raise ValueError(
                f"the request holds a lone UTF-16 surrogate ({bad}), which is not text"
            ) from None
        return self

    @field_validator("stop")
    @classmethod
    def _stops_not_empty(cls, value: str | list[str] | None) -> str | list[str] | None:
        stops = [value] if isinstance(value, str) else value or []
        if any(stop == "" for stop in stops):
            raise ValueError("stop strings must not be empty")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _bias_in_range(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        for token, bias in (value or {}).items():
            if not (token.isascii() and token.isdigit()):  # "²" and "٣" are digits to Python
                raise ValueError(f"logit_bias keys are token ids, got {token!r}")
            if not -100 <= bias <= 100:
                raise ValueError(f"logit_bias values are in -100…100, got {bias} for token {token}")
        return value

    def bias(self, vocab_size: int) -> tuple[tuple[int, float], ...]:
        """logit_bias as (id, bias) pairs; an id outside the vocabulary is a UsageError."""
        pairs = tuple((int(token), float(bias)) for token, bias in (self.logit_bias or {}).items())
        outside = [token for token, _ in pairs if token >= vocab_size]
        if outside:
            raise UsageError(f"logit_bias names token {outside[0]}; the vocabulary has {vocab_size} tokens")
        return pairs

    def sampling(self) -> SamplingSettings:
        stops = [self.stop] if isinstance(self.stop, str) else self.stop or []
        values = {name: getattr(self, OPENAI_NAMES.get(name, name)) for name in SAMPLING_NUMBERS}
        values["max_new_tokens"] = self.max_completion_tokens or values["max_new_tokens"]
        return SamplingSettings(**values, stop=tuple(stops))

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ImageUrl(BaseModel):
    model_config = ConfigDict(extra="forbid")

    url: str
    detail: str | None = None  # refused unless "auto" (ChatMessage.parts)


class ImageUrlPart(BaseModel):
    """OpenAI's image part: a data URL, or an http(s) URL (fetched only where the server allows)."""

    type: Literal["image_url"]
    image_url: ImageUrl


class ImagePart(BaseModel):
    """An image another protocol's adapter has read (server/images.py): never sent as JSON."""

    type: Literal["image"]
    image: InstanceOf[ImageRef]


class CalledFunction(BaseModel):
    model_config = ConfigDict(extra="ignore")

    name: str
    arguments: str | dict[str, Any]  # JSON text, as OpenAI sends it (some clients send the object)


class CallIn(BaseModel):
    """An earlier call, in an assistant message."""

    model_config = ConfigDict(extra="ignore")

    id: str
    type: Literal["function"] = "function"
    function: CalledFunction


def _check_image_url(image: Any) -> None:
    """An image_url part's object, said plainly where it is wrong (pydantic's union of the
    content's shapes would name the first shape it tried, `str`)."""
    if not isinstance(image, dict) or not isinstance(image.get("url"), str):
        raise ValueError('an image_url part is {"type": "image_url", "image_url": {"url": "data:…"}}')
    unknown = sorted(set(image) - {"url", "detail"})
    if unknown:
        raise ValueError(f"image_url.{unknown[0]} is not supported here")


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart | ImageUrlPart | ImagePart] | None = None
    tool_calls: list[CallIn] | None = None  # an assistant's calls
    tool_call_id: str | None = None  # a tool result: the call it answers

    @field_validator("content", mode="before")
    @classmethod
    def _known_parts_only(cls, value: Any) -> Any:
        for part in value if isinstance(value, list) else ():
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "image" and isinstance(part.get("image"), ImageRef):
                continue  # read by another protocol's adapter
            if kind not in ("text", "image_url"):  # input_audio, file: refused, never dropped
                raise ValueError(f"{kind} parts are not supported here (text and image_url are)")
            if kind == "image_url":
                _check_image_url(part.get("image_url"))
        return value

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content if isinstance(part, TextPart))
        return self.content or ""

    def parts(self, position: int) -> str | list[dict[str, Any]]:
        """The content in the neutral form (server/images.py): its text, or, where it holds an
        image, its parts, each image an ImageRef named `messages[position].content[i]`."""
        content = self.content
        if not isinstance(content, list) or all(isinstance(part, TextPart) for part in content):
            return self.text()
        if self.role != "user":
            raise UsageError(f"messages[{position}]: images are taken in user messages only")
        parts: list[dict[str, Any]] = []
        for index, part in enumerate(content):
            if isinstance(part, TextPart):
                parts.append({"type": "text", "text": part.text})
            elif isinstance(part, ImagePart):
                parts.append(image_part(part.image))
            else:
                label = f"messages[{position}].content[{index}]"
                refuse_detail(part.image_url.detail, label)
                parts.append(image_part(from_url(part.image_url.url, label, "image_url parts")))
        return parts


class ChatRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    # Keywords for the chat template, as vLLM takes them: {"enable_thinking": false} above all.
    chat_template_kwargs: dict[str, Any] | None = None
    reasoning_effort: Literal["minimal", "low", "medium", "high"] | None = None  # for templates that read it
    # Checked by engine/tools/offered.py (parse_tools, parse_choice): its messages name the tool at fault.
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    think_budget: int | None = Field(default=None, ge=1)  # llmcli's own: thinking tokens at most
    logprobs: bool = False  # each token's log-probability (the model's own log-softmax)
    top_logprobs: int | None = Field(default=None, ge=0, le=20)  # and this many alternatives
    # OpenAI's deprecated form of tools: refused with a pointer to `tools`, never ignored.
    functions: list[Any] | None = None
    function_call: Any = None

    # Custom tools (freeform input under a grammar) are taken where the protocol can answer
    # their calls as such: the Responses API's adapter says so (responses.py).
    custom_tools: ClassVar[bool] = False
    # reasoning_effort on a template that reads none: refused, except where the protocol defines
    # effort as a hint that a model's own thinking answers (the Responses API's adapter says so).
    effort_is_a_hint: ClassVar[bool] = False

    def tool_request(self) -> ToolRequest | None:
        """The tools on offer; None when none are (a tool_choice without tools is refused)."""
        from llmcli.engine.tools import ToolRequest
        from llmcli.engine.tools.offered import parse_choice, parse_tools

        if self.functions is not None or self.function_call is not None:
            raise UsageError(
                "functions and function_call are OpenAI's deprecated form: send tools and tool_choice"
            )
        if not self.tools:
            if self.tool_choice not in (None, "none", "auto"):
                raise UsageError("tool_choice needs tools")
            return None
        tools = parse_tools(self.tools, "tools", custom=self.custom_tools)
        choice = parse_choice(self.tool_choice, tools, "tool_choice")
        return ToolRequest(tools, choice, self.parallel_tool_calls)

    @property
    def think_off(self) -> bool:
        return (self.chat_template_kwargs or {}).get("enable_thinking") is False

    def logprob_count(self) -> int | None:
        """Alternatives to report per token (0: the chosen token's only); None: no logprobs."""
        if self.top_logprobs is not None and not self.logprobs:
            raise UsageError("top_logprobs needs logprobs: true")
        return (self.top_logprobs or 0) if self.logprobs else None

    def chat_messages(self) -> list[dict[str, Any]]:
        """The messages for the template, in the neutral form (server/images.py); a bad image
        is a UsageError naming it."""
        roles = {"developer": "system"}  # OpenAI's newer name for the system role
        messages: list[dict[str, Any]] = []
        for position, message in enumerate(self.messages):
            role = roles.get(message.role, message.role)
            shaped: dict[str, Any] = {"role": role, "content": message.parts(position)}
            if message.tool_calls:
                shaped["tool_calls"] = [call.model_dump() for call in message.tool_calls]
            if message.role == "tool":
                shaped["tool_call_id"] = message.tool_call_id
            messages.append(shaped)
        return messages


class CompletionRequest(_Sampling):
    # A text, several texts, token ids, or several lists of token ids: a choice per prompt.
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(default=None, ge=0, le=5)  # alternatives per token, as OpenAI's
    echo: bool = False  # the prompt, and its tokens' log-probabilities, before the completion
    # 0 with echo: score the prompt only (lm-eval's loglikelihood requests).
    max_tokens: int | None = Field(default=None, ge=0)
    best_of: int | None = None  # refused above 1: one completion is generated per prompt
    suffix: str | None = None  # refused: no fill-in-the-middle here

    @field_validator("best_of")
    @classmethod
    def _one_best(cls, value: int | None) -> int | None:
        if value is not None and value != 1:
            raise ValueError("best_of is not supported: one completion is generated per prompt")
        return value

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, value: str | None) -> str | None:
        if value:
            raise ValueError("suffix (fill in the middle) is not supported")
        return value

    @property
    def scores_only(self) -> bool:
        return self.max_tokens == 0

    @field_validator("prompt")
    @classmethod
    def _some_prompt(cls, value: Any) -> Any:
        if isinstance(value, list) and (not value or any(isinstance(p, list) and not p for p in value)):
            raise ValueError("a prompt is a text or token ids, and none may be empty")
        if isinstance(value, list) and len(value) > 64 and not isinstance(value[0], int):
            raise ValueError("at most 64 prompts per request")
        return value

    def prompt_ids(self, tokenizer: Any, context_length: int) -> list[list[int]]:
        """Each prompt's token ids: texts tokenized (with the tokenizer's BOS), ids as given;
        a text that cannot fit the context is refused before it is tokenized."""
        from llmcli.engine.prompt_bounds import refuse_unfittable

        prompt = self.prompt
        if isinstance(prompt, str):
            prompt = [prompt]
        if prompt and isinstance(prompt[0], int):
            return [list(prompt)]  # type: ignore[arg-type]
        for text in prompt:
            if isinstance(text, str):
                refuse_unfittable(tokenizer, [text], context_length)
        return [
            list(p) if isinstance(p, list) else list(tokenizer(p, add_special_tokens=True)["input_ids"])
            for p in prompt
        ]

    @staticmethod
    def check_ids(prompts: list[list[int]], vocab_size: int) -> None:
        for ids in prompts:
            outside = [token for token in ids if not 0 <= token < vocab_size]
            if outside:
                raise UsageError(f"prompt token {outside[0]} is not in the vocabulary ({vocab_size} tokens)")


def error_body(message: str, kind: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    """OpenAI's error object."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


OPENAI_KINDS = {401: "authentication_error", 403: "permission_error", 404: "not_found_error"}
ANTHROPIC_KINDS = OPENAI_KINDS | {413: "request_too_large", 429: "rate_limit_error"}


def error_for(
    path: str, status: int, message: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    """An error in the shape of the protocol the request's path speaks: Ollama's {"error": "…"}
    under /api/, Anthropic's under /v1/messages, OpenAI's error object elsewhere. Every answer
    that is not a route's own (the guards, the body's checks) is shaped here too."""
    if path.startswith("/api/"):
        return {"error": message}
    if path.startswith("/v1/messages"):
        kind = ANTHROPIC_KINDS.get(status, "invalid_request_error" if status < 500 else "api_error")
        return {"type": "error", "error": {"type": kind, "message": message}}
    kind = OPENAI_KINDS.get(status, "invalid_request_error" if status < 500 else "server_error")
    return error_body(message, kind, param, code)
