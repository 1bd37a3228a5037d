"""Chat transcripts (/save, /load): a JSON file of the chat's system prompt, settings and messages.

A transcript is a file anyone may have edited, so /load checks every field before anything of
the chat changes: a wrong type anywhere (`"system": 5`, `"settings": [1, 2]`, `"stop": [["x"]]`)
is one line naming the file and the field, and the chat goes on as it was. A field llmcli does
not know is refused as well, never ignored.
"""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llmcli.atomic import write_text_atomically
from llmcli.errors import LlmcliError, UsageError

TRANSCRIPT_VERSION = 1
TOP_LEVEL = {"version", "model", "system", "settings", "messages"}
MESSAGE_KEYS = {
    "user": {"role", "content"},
    "assistant": {"role", "content", "tool_calls", "interrupted"},
    "tool": {"role", "content", "tool_call_id", "name"},
}


@dataclass(frozen=True)
class Transcript:
    system: str | None
    settings: dict[str, Any]
    messages: list[dict[str, Any]]


def read_transcript(path: Path, settable: tuple[str, ...]) -> Transcript:
    """The transcript at `path`, every field checked; `settable`: the settings it may carry."""
    from llmcli.reading import TRANSCRIPT_BYTES, parse_json, read_text

    data = parse_json(read_text(path, TRANSCRIPT_BYTES, str(path)), f"{path} (a chat transcript)")
    if not isinstance(data, dict) or data.get("version") != TRANSCRIPT_VERSION:
        raise UsageError(f"{path} is not an llmcli chat transcript (version {TRANSCRIPT_VERSION})")
    where = str(path)
    _known(data, TOP_LEVEL, where)
    if data.get("model") is not None and not isinstance(data["model"], str):
        raise _wrong(where, "model", "a text")
    system = data.get("system")
    if system is not None and not isinstance(system, str):
        raise _wrong(where, "system", "a text or null")
    return Transcript(
        system or None, _settings(data.get("settings"), settable, where), _messages(data, where)
    )


def write_transcript(path: Path, data: dict[str, Any]) -> None:
    data = {**data, "messages": [_saved(message) for message in data.get("messages", [])]}
    try:
        # Whole or not at all: /save over an earlier transcript never leaves half of either.
        write_text_atomically(path.expanduser(), json.dumps(data, ensure_ascii=False, indent=2) + "\n")
    except OSError as error:
        raise LlmcliError(f"cannot write {path}: {error.strerror}") from error


def _settings(settings: Any, settable: tuple[str, ...], where: str) -> dict[str, Any]:
    if settings is None:
        return {}
    if not isinstance(settings, dict):
        raise _wrong(where, "settings", "an object")
    _known(settings, set(settable), f"{where}: settings")
    for key, value in settings.items():
        if key == "stop":
            if value is not None and not (isinstance(value, list) and all(isinstance(s, str) for s in value)):
                raise _wrong(where, "settings.stop", "a list of texts, or null")
        elif key == "seed":
            if value is not None and not _is_int(value):
                raise _wrong(where, "settings.seed", "an integer, or null")
        elif value is not None and not (_is_int(value) or isinstance(value, float)):
            raise _wrong(where, f"settings.{key}", "a number")
    return {key: value for key, value in settings.items() if value is not None or key in ("seed", "stop")}


def _messages(data: dict[str, Any], where: str) -> list[dict[str, Any]]:
    messages = data.get("messages")
    if not isinstance(messages, list):
        raise _wrong(where, "messages", "a list")
    for number, message in enumerate(messages):
        field = f"messages[{number}]"
        if not isinstance(message, dict) or message.get("role") not in MESSAGE_KEYS:
            raise _wrong(where, field, "an object with a role of user, assistant or tool")
        _known(message, MESSAGE_KEYS[message["role"]], f"{where}: {field}")
        if message["role"] == "user" and isinstance(message.get("content"), list):
            message["content"] = _loaded_parts(message["content"], f"{field}.content", where)
        elif not isinstance(message.get("content"), str):
            raise _wrong(where, f"{field}.content", "a text")
        if "interrupted" in message and not isinstance(message["interrupted"], bool):
            raise _wrong(where, f"{field}.interrupted", "true or false")
        if message["role"] == "tool" and not isinstance(message.get("tool_call_id"), str):
            raise _wrong(where, f"{field}.tool_call_id", "a text")
        if "name" in message and not isinstance(message["name"], str):
            raise _wrong(where, f"{field}.name", "a text")
        if "tool_calls" in message and not isinstance(message["tool_calls"], list):
            raise _wrong(where, f"{field}.tool_calls", "a list")
        for position, call in enumerate(message.get("tool_calls") or []):
            _check_call(call, f"{field}.tool_calls[{position}]", where)
    return messages


def _check_call(call: Any, field: str, where: str) -> None:
    function = call.get("function") if isinstance(call, dict) else None
    well_formed = (
        isinstance(call, dict)
        and isinstance(call.get("id"), str)
        and call.get("type", "function") == "function"
        and isinstance(function, dict)
        and isinstance(function.get("name"), str)
        and isinstance(function.get("arguments"), str)
    )
    if not well_formed:
        raise _wrong(where, field, 'a call: {"id", "type": "function", "function": {"name", "arguments"}}')


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _known(record: dict[str, Any], known: set[str], where: str) -> None:
    unknown = sorted(set(record) - known)
    if unknown:
        raise UsageError(f"{where}: unknown field {unknown[0]!r} (known: {', '.join(sorted(known))})")


def _wrong(where: str, field: str, expected: str) -> UsageError:
    return UsageError(f"{where}: {field} must be {expected}", "fix the file, or /save a new one")


def _saved(message: dict[str, Any]) -> dict[str, Any]:
    """A message as a transcript holds it: an image part as its bytes in base64, and its label."""
    content = message.get("content")
    if not isinstance(content, list):
        return message
    return {**message, "content": [_saved_part(part) for part in content]}


def _saved_part(part: dict[str, Any]) -> dict[str, Any]:
    if part.get("type") != "image":
        return part
    image = part["image"]
    return {"type": "image", "label": image.label, "data": base64.b64encode(image.data).decode("ascii")}


def _loaded_parts(parts: list[Any], field: str, where: str) -> list[dict[str, Any]]:
    """A user message's text and image parts, as /save wrote them."""
    from llmcli.models.vision.encoder import ImageInput

    loaded: list[dict[str, Any]] = []
    for position, part in enumerate(parts):
        here = f"{field}[{position}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str):
            loaded.append({"type": "text", "text": part["text"]})
        elif kind == "image" and isinstance(part.get("data"), str) and isinstance(part.get("label"), str):
            try:
                data = base64.b64decode(part["data"], validate=True)
            except ValueError:
                raise _wrong(where, f"{here}.data", "an image's bytes in base64") from None
            loaded.append({"type": "image", "image": ImageInput(data, part["label"])})
        else:
            raise _wrong(where, here, '{"type": "text", "text"} or {"type": "image", "label", "data"}')
    return loaded
