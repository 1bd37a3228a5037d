"""Reasoning models: where the thinking is, recognised from the chat template and the tokenizer
(never from the model's name), and the reply's text split into thinking and answer as it streams.

A format is a small data entry. Qwen3, the DeepSeek-R1 distills, SmolLM3 and Phi-4-reasoning all
write `<think>…</think>`; some templates open the block in the generation prompt (the model starts
inside it), some let the model open it, and some read `enable_thinking` to switch it off.
gpt-oss writes OpenAI's harmony channels: `<|channel|>analysis<|message|>…<|end|>` is its
thinking, and `<|start|>assistant<|channel|>final<|message|>` opens the answer. Those markers are
special tokens, which a reply's text would drop: for such a format the text keeps them, and the
split takes them out.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from llmcli.engine.detok import decode_exact

REASONING = "reasoning"
CONTENT = "content"


@dataclass(frozen=True)
class ThinkFormat:
    name: str
    start: str
    end: str
    detect: str  # in a chat template: the model writes this format
    close_open: str  # appended to a prompt that opened a block, to answer without thinking
    empty: str  # appended to a prompt, an empty block: the model answers without thinking
    answer_openers: tuple[str, ...] = ()  # framing that may open the answer, never shown
    special: bool = False  # its markers are special tokens: the reply's text must keep them


THINK_TAGS = ThinkFormat(
    "think tags", "<think>", "</think>", "</think>", "\n</think>\n\n", "<think>\n\n</think>\n\n"
)
HARMONY_FINAL = "<|start|>assistant<|channel|>final<|message|>"
HARMONY = ThinkFormat(
    "harmony channels",
    "<|channel|>analysis<|message|>",
    "<|end|>",
    "<|channel|>analysis",
    "<|end|>" + HARMONY_FINAL,
    "<|channel|>analysis<|message|><|end|>" + HARMONY_FINAL,
    # The final channel's header; or the message header alone, before a call's channel.
    answer_openers=(HARMONY_FINAL, "<|channel|>final<|message|>", "<|start|>assistant"),
    special=True,
)
# One entry per way of marking thinking; each is tested in tests/test_reasoning.py.
THINK_FORMATS = (THINK_TAGS, HARMONY)


@dataclass(frozen=True)
class Thinking:
    """How a model thinks: its format, and whether its template reads `enable_thinking`."""

    format: ThinkFormat
    switchable: bool


def thinking_of(tokenizer: Any) -> Thinking | None:
    """The model's thinking format: its end marker in the chat template, or both markers among
    the tokenizer's added tokens. None for a model that does not think."""
    template = getattr(tokenizer, "chat_template", None) or ""
    if isinstance(template, dict):  # named templates: look at them all
        template = "\n".join(str(text) for text in template.values())
    try:
        added = set(tokenizer.get_added_vocab())
    except (AttributeError, TypeError):
        added = set()
    for think in THINK_FORMATS:
        if think.detect in template or {think.start, think.end} <= added:
            return Thinking(think, "enable_thinking" in template)
    return None


def keeps_special_tokens(tokenizer: Any) -> bool:
    """Whether a reply's text must keep special tokens for its thinking to be split out."""
    thinking = thinking_of(tokenizer) if tokenizer is not None else None
    return thinking is not None and thinking.format.special


@dataclass(frozen=True)
class PromptThinking:
    """Where a prompt leaves a reasoning model: its format, whether the generation prompt
    opened a block (`inside`), and the part of that block the prompt wrote (`opener`)."""

    format: ThinkFormat
    inside: bool
    opener: str


def prompt_thinking(tokenizer: Any, prompt_ids: list[int]) -> PromptThinking | None:
    """None for no tokenizer or a model that does not think. The prompt's last tokens say
    whether the generation prompt opened a block."""
    thinking = thinking_of(tokenizer) if tokenizer is not None else None
    if thinking is None:
        return None
    think = thinking.format
    tail = decode_exact(tokenizer, prompt_ids[-64:])
    inside = opens_thinking(tail, think)
    return PromptThinking(think, inside, tail[tail.rfind(think.start) :] if inside else "")


def opens_thinking(prompt_text: str, think: ThinkFormat) -> bool:
    """Whether the prompt leaves the model inside a think block (its last start marker comes
    after its last end marker: the generation prompt opened one)."""
    return prompt_text.rfind(think.start) > prompt_text.rfind(think.end)


def closing_text(prompt_text: str, think: ThinkFormat) -> str:
    """What to append to a prompt so that the model answers without thinking, for a template
    that has no switch: the open block closed, or an empty block."""
    return think.close_open if opens_thinking(prompt_text, think) else think.empty


class ThinkSplitter:
    """Streamed text → (channel, text) pieces: thinking, then the answer. The markers are never
    shown, a marker split across pieces is held back until it is whole, and the blank lines
    after the end marker are the answer's framing, not its text."""

    def __init__(self, think: ThinkFormat, inside: bool) -> None:
        self.think = think
        self.inside = inside
        self._held = ""
        self._at_start = not inside  # an answer may still open a think block
        self._after_end = False
        self.said: dict[str, list[str]] = {REASONING: [], CONTENT: []}  # every piece given out
        self.thought = inside  # whether any thinking happened
        self.started_inside = inside

    def text(self, channel: str) -> str:
        """Everything given out on `channel` so far."""
        return "".join(self.said[channel])

    def feed(self, text: str) -> list[tuple[str, str]]:
        self._held += text
        out: list[tuple[str, str]] = []
        while self._held:
            if self.inside:
                if not self._reasoning(out):
                    break
            elif not self._content(out):
                break
        return self._given(out)

    def flush(self) -> list[tuple[str, str]]:
        """At the end: what was held back as a possible marker was text after all."""
        held, self._held = self._held, ""
        return self._given([(REASONING if self.inside else CONTENT, held)])

    def _given(self, out: list[tuple[str, str]]) -> list[tuple[str, str]]:
        pieces = [(channel, piece) for channel, piece in out if piece]
        for channel, piece in pieces:
            self.said[channel].append(piece)
        return pieces

    def _reasoning(self, out: list[tuple[str, str]]) -> bool:
        """Thinking up to the end marker; False when the rest must wait for more text."""
        end = self.think.end
        found = self._held.find(end)
        if found >= 0:
            out.append((REASONING, self._held[:found]))
            self._held = self._held[found + len(end) :]
            self.inside, self._after_end = False, True
            return True
        keep = partial_suffix(self._held, end)
        out.append((REASONING, self._held[: len(self._held) - keep]))
        self._held = self._held[len(self._held) - keep :]
        return False

    def _content(self, out: list[tuple[str, str]]) -> bool:
        start, openers = self.think.start, self.think.answer_openers
        if self._at_start or self._after_end:
            stripped = self._held.lstrip()
            if not stripped:
                return False  # only blank so far: it may be framing
            if self._at_start and stripped.startswith(start):
                self._held, self.inside, self._at_start = stripped[len(start) :], True, False
                self.thought = True
                return True
            if self._at_start and start.startswith(stripped):
                return False  # could still become the start marker
            opener = next((o for o in openers if stripped.startswith(o)), None)
            if opener is not None:  # the answer's framing: the answer starts after it
                self._held, self._at_start, self._after_end = stripped[len(opener) :], False, True
                return True
            if any(o.startswith(stripped) for o in openers):
                return False  # could still become an opener
            if self._after_end:
                self._held = stripped
            self._at_start = self._after_end = False
        out.append((CONTENT, self._held))
        self._held = ""
        return True


def partial_suffix(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `marker`."""
    for length in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:length]):
            return length
    return 0


def reasoning_tokens(decode: Any, token_ids: list[int], think: ThinkFormat, inside: bool) -> int:
    """How many of the reply's tokens are thinking, end marker included: the fewest whose text
    holds the end marker (a binary search, a few decodes), all of them when it never came, none
    when the reply did not think. `decode`: ids → text, special tokens kept."""
    if not token_ids:
        return 0
    whole = decode(token_ids)
    if not inside and not whole.lstrip().startswith(think.start):
        return 0
    if think.end not in whole:
        return len(token_ids)
    low, high = 1, len(token_ids)  # the smallest k with the end marker in decode(ids[:k])
    while low < high:
        middle = (low + high) // 2
        if think.end in decode(token_ids[:middle]):
            high = middle
        else:
            low = middle + 1
    return low


class ThinkTracker:
    """Token by token in the loop: whether the reply is thinking, how many tokens it thought,
    and, at a budget, the end marker to force so that the model goes on to its answer."""

    def __init__(self, think: ThinkFormat, inside: bool, end_ids: list[int], budget: int | None) -> None:
        self._splitter = ThinkSplitter(think, inside)
        self.end_ids = end_ids
        self.budget = budget
        self.tokens = 0
        self._forced = False

    @property
    def thinking(self) -> bool:
        return self._splitter.inside

    def take(self, piece: str) -> list[int]:
        """One token taken, and the text it completes; the ids to force next ([] for none)."""
        was_thinking = self.thinking
        self._splitter.feed(piece)
        if was_thinking:
            self.tokens += 1
        if self.thinking and self.budget is not None and self.tokens >= self.budget and not self._forced:
            self._forced = True
            return list(self.end_ids)
        return []


def think_tracker(tokenizer: Any, prompt_ids: list[int], budget: int | None) -> ThinkTracker | None:
    """The loop's tracker for a reasoning model's reply (None for a model that does not think)."""
    start = prompt_thinking(tokenizer, prompt_ids)
    if start is None:
        return None
    end_ids = list(tokenizer(start.format.end, add_special_tokens=False)["input_ids"])
    return ThinkTracker(start.format, start.inside, end_ids, budget)


class ThinkingStream:
    """A reply's text pieces as (channel, text), for whatever model: a model that does not
    think gives its pieces as the answer. Afterwards, `summary` gives the answer, the thinking
    and how many tokens the thinking took."""

    def __init__(self, tokenizer: Any, prompt_ids: list[int]) -> None:
        self.tokenizer = tokenizer
        start = prompt_thinking(tokenizer, prompt_ids)
        self.splitter = ThinkSplitter(start.format, start.inside) if start else None
        self.opener = start.opener if start else ""  # the part of the block the prompt wrote

    def split(self, pieces: Iterable[str]) -> Iterator[tuple[str, str]]:
        splitter = self.splitter
        for piece in pieces:
            yield from splitter.feed(piece) if splitter else [(CONTENT, piece)]
        if splitter:
            yield from splitter.flush()

    def said(self, text: str) -> str:
        """The reply as the assistant's message of a chat: the block the generation prompt
        opened, then what the model wrote (the template decides what it keeps of it). A format
        of special tokens keeps the answer alone: as message text its markers would be escaped,
        and harmony templates drop earlier turns' thinking anyway."""
        if self.splitter is not None and self.splitter.think.special:
            self.splitter.flush()
            return self.splitter.text(CONTENT)
        return self.opener + text

    def summary(self, text: str, token_ids: list[int]) -> tuple[str, str | None, int | None]:
        """(the answer, the thinking or None, its tokens or None) of a reply whose whole text
        is `text`; a reply cut short (Ctrl-C) counts what was split before the cut."""
        splitter = self.splitter
        if splitter is None:
            return text, None, None
            splitter.flush()
        decode = functools.partial(decode_exact, self.tokenizer)
        tokens = reasoning_tokens(decode, token_ids, splitter.think, splitter.started_inside)
        return splitter.text(CONTENT), splitter.text(REASONING) if splitter.thought else None, tokens
