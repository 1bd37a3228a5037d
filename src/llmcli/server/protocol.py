"""The OpenAI request bodies llmcli accepts, and its error objects.

Unknown fields are ignored (clients send `user`, `logprobs: false`, …); known fields of the wrong
type or out of range are a 422 naming the field. llmcli's own sampling controls (top_k, min_p,
repetition_penalty) ride along as extra fields, as vLLM and llama.cpp's server accept them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from llmcli.config.declare import declarations
from llmcli.config.settings import SamplingSettings
from llmcli.errors import UsageError

if TYPE_CHECKING:
    from llmcli.engine.structured import OutputFormat


class StreamOptions(BaseModel):
    include_usage: bool = False


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    name: str | None = None
    schema_: dict[str, Any] | bool = Field(default=True, alias="schema")
    strict: bool | None = None  # always strict here: the grammar allows nothing else


class ResponseFormat(BaseModel):
    """OpenAI's response_format: text, any JSON object, or JSON valid under a schema."""

    model_config = ConfigDict(extra="ignore")

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


def _bounded(name: str) -> Any:
    """An optional sampling field with the bounds its setting declares (config/settings.py)."""
    bounds = declarations(SamplingSettings)[name].bounds
    return Field(default=None, **(bounds.pydantic() if bounds else {}))


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: int | None = _bounded("max_new_tokens")
    max_completion_tokens: int | None = _bounded("max_new_tokens")
    temperature: float | None = _bounded("temperature")
    top_p: float | None = _bounded("top_p")
    top_k: int | None = _bounded("top_k")
    min_p: float | None = _bounded("min_p")
    repetition_penalty: float | None = _bounded("repetition_penalty")
    seed: int | None = _bounded("seed")
    stop: str | list[str] | None = None
    n: int = Field(default=1, ge=1, le=1)  # one choice per request: batch-1 decode
    speculative: Literal["off", "lookup", "draft"] | None = None  # llmcli's: default, the server's
    response_format: ResponseFormat | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None

    @field_validator("stop")
    @classmethod
    def _stops_not_empty(cls, value: str | list[str] | None) -> str | list[str] | None:
        stops = [value] if isinstance(value, str) else value or []
        if any(stop == "" for stop in stops):
            raise ValueError("stop strings must not be empty")
        return value

    def sampling(self) -> SamplingSettings:
        stops = [self.stop] if isinstance(self.stop, str) else self.stop or []
        return SamplingSettings(
            temperature=self.temperature,
            top_k=self.top_k,
            top_p=self.top_p,
            min_p=self.min_p,
            repetition_penalty=self.repetition_penalty,
            max_new_tokens=self.max_completion_tokens or self.max_tokens,
            seed=self.seed,
            stop=tuple(stops),
        )

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class ChatRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)

    def chat_messages(self) -> list[dict[str, str]]:
        roles = {"developer": "system"}  # OpenAI's newer name for the system role
        return [{"role": roles.get(m.role, m.role), "content": m.text()} for m in self.messages]


class CompletionRequest(_Sampling):
    prompt: str | list[str]

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, value: str | list[str]) -> str | list[str]:
        if isinstance(value, list) and len(value) != 1:
            raise ValueError("one prompt per request")
        return value

    def text(self) -> str:
        return self.prompt if isinstance(self.prompt, str) else self.prompt[0]


def error_body(message: str, kind: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    """OpenAI's error object."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}
