"""Calls read back out of a reply as it streams: text, then each call's id and name, then its
arguments in pieces (the shape of OpenAI's streamed tool_calls deltas).

The grammar wrote the calls, so they have one shape: the opener, `{"name": "…", "<arguments
key>": {…}}`, the text between calls or the closer. The reader only finds where each part
ends: the end of the arguments object is the brace that brings its depth back to zero,
outside strings.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from dataclasses import dataclass, field

from llmcli.engine.reasoning import partial_suffix
from llmcli.engine.tools import ToolCall, new_call_id
from llmcli.engine.tools.formats import ToolFormat


@dataclass(frozen=True)
class CallStart:
    index: int
    id: str
    name: str


@dataclass(frozen=True)
class CallArguments:
    index: int
    text: str


Event = str | CallStart | CallArguments  # text of the answer, or a part of a call


@dataclass
class _Call:
    id: str
    name: str
    arguments: str = ""
    done: bool = False


@dataclass
class ToolCallReader:
    fmt: ToolFormat
    calls: list[_Call] = field(default_factory=list)
    _state: str = "text"  # text, head, arguments, after, done
    _held: str = ""  # text not decided yet
    _all: str = ""  # everything fed: a call cut short is given back as the text it was
    _cut_from: int = 0  # where in `_all` the call in progress began (its opener, for the first)
    _depth: int = 0
    _in_string: bool = False
    _escaped: bool = False
    _started: bool = False  # anything but blanks seen in the answer

    def __post_init__(self) -> None:
        key = re.escape(json.dumps(self.fmt.arguments_key))
        self._head = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*' + key + r"\s*:\s*")

    def feed(self, piece: str) -> list[Event]:
        self._held += piece
        self._all += piece
        events: list[Event] = []
        while self._step(events):
            pass
        return events

    def finish(self) -> list[Event]:
        """The end of the reply: held text is the answer's; a call cut short (the length
        limit) is text too, so that nothing written is lost."""
        events: list[Event] = []
        if self._state == "after":
            self._after(ended=True)
        if self._state == "text" and self._held and (self._started or not self.calls):
            events.append(self._held)
        elif self._state in ("head", "arguments", "after"):  # a call cut short: text, as written
            if self._state != "head":
                self.calls.pop()
            events.append(self._all[self._cut_from :])
        self._held = ""
        return events

    def tool_calls(self) -> list[ToolCall]:
        return [ToolCall(call.id, call.name, call.arguments) for call in self.calls if call.done]

    def _step(self, events: list[Event]) -> bool:
        """Take what the held text decides; False when it must wait for more."""
        state = self._state
        if state == "text":
            return self._text(events)
        if state == "head":
            if self.fmt.header_end:
                return self._header(events)
            match = self._head.match(self._held)
            if match is None:
                return False
            call = _Call(new_call_id(), json.loads(match.group(1)))
            self.calls.append(call)
            events.append(CallStart(len(self.calls) - 1, call.id, call.name))
            self._held = self._held[match.end() :]
            self._state, self._depth, self._in_string, self._escaped = "arguments", 0, False, False
            return True
        if state == "arguments":
            return self._arguments(events)
        if state == "after":
            return self._after()
        self._held = ""  # done: the grammar allows nothing after the closer
        return False

    def _text(self, events: list[Event]) -> bool:
        held = self._held
        if self.fmt.at_reply_start:
            stripped = held.lstrip()
            if not stripped:
                return False
            if stripped.startswith("{") and not self._started:
                self._cut_from = len(self._all) - len(stripped)
                self._state, self._held = "head", stripped
                return True
            self._started = True
            events.append(held)
            self._held = ""
            return False
        trigger = self.fmt.opener
        at = held.find(trigger)
        if at >= 0:
            before = held[:at]
            if before.strip() or self._started:
                events.append(before)
            self._cut_from = len(self._all) - len(held) + at
            self._state, self._held = "head", held[at + len(trigger) :]
            return True
        keep = partial_suffix(held, trigger)
        out = held[: len(held) - keep]
        if out.strip():  # blanks before a call are framing, not an answer: held until known
            self._started = True
        if out and self._started:
            events.append(out)
            self._held = held[len(out) :]
        return False

    def _header(self, events: list[Event]) -> bool:
        """harmony: the tool's name up to the header's end, then its arguments bare."""
        end = self._held.find(self.fmt.header_end)
        if end < 0:
            return False
        call = _Call(new_call_id(), self._held[:end])
        self.calls.append(call)
        events.append(CallStart(len(self.calls) - 1, call.id, call.name))
        self._held = self._held[end + len(self.fmt.header_end) :]
        self._state, self._depth, self._in_string, self._escaped = "arguments", 0, False, False
        return True

    def _arguments(self, events: list[Event]) -> bool:
        if not self.calls[-1].arguments:  # the object starts at its "{": blanks before it wait
            self._held = self._held.lstrip()
            if not self._held:
                return False
        held, end = self._held, None
        for position, char in enumerate(held):
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif char == "\\":
                    self._escaped = True
                elif char == '"':
                    self._in_string = False
            elif char == '"':
                self._in_string = True
            elif char in "{[":
                self._depth += 1
            elif char in "}]":
                self._depth -= 1
                if self._depth == 0:
                    end = position + 1
                    break
        taken = held if end is None else held[:end]
        call = self.calls[-1]
        if taken:
            call.arguments += taken
            events.append(CallArguments(len(self.calls) - 1, taken))
        self._held = "" if end is None else held[end:]
        if end is None:
            return False
        self._state = "after"
        return True

    def _after(self, ended: bool = False) -> bool:
        """After the arguments: the call object's "}", then the next call or the closer (the
        closer may begin the text between calls: known when more comes, or at the end)."""
        if self.fmt.header_end:  # harmony: the bare arguments were the call; <|call|> ends the reply
            self.calls[-1].done = True
            self._state, self._held = "done", ""
            return False
        held = self._held.lstrip(" ")
        if not held.startswith("}"):
            return False
        rest, between, closer = held[1:], self.fmt.between, self.fmt.closer
        if between and rest.startswith(between):
            self.calls[-1].done = True
            self._state, self._held = "head", rest[len(between) :]
            self._cut_from = len(self._all) - len(self._held)
            return True
        if between and between.startswith(rest) and not ended:
            return False
        if rest.startswith(closer):
            self.calls[-1].done = True
            self._state, self._held = "done", ""
        return False


def read_calls(fmt: ToolFormat, pieces: Iterable[str]) -> tuple[str, list[ToolCall]]:
    """A whole reply's answer text and calls."""
    reader = ToolCallReader(fmt)
    text: list[str] = []
    for piece in [*pieces, None]:
        events = reader.finish() if piece is None else reader.feed(piece)
        text += [event for event in events if isinstance(event, str)]
    return "".join(text), reader.tool_calls()
