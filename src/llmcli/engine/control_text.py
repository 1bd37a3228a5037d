"""Text a user wrote stays text: `<|im_end|>` in a message is tokenized as the characters it
spells, never as the control token, so no message can close its turn or forge a system one.

Only the chat template's own markup may produce control tokens. Before rendering, every control
token's text inside the values handed to the template (messages, tools, the template's keywords)
is wrapped in two private-use characters; after rendering, the text between such a pair is
encoded without added tokens, and everything else as usual. A template that cuts a message apart
(`content.split('</think>')`) may leave one marker alone: it is dropped, but still splits the
text, so the two sides cannot join into a control token again. Text without control tokens is
not touched, so its ids are exactly what tokenizing the whole prompt gives.

Control tokens: the tokenizer's special tokens, and the other added tokens the template itself
writes (Qwen's `<think>`, `<tool_call>`); whitespace tokens (Gemma's "\\n") are ordinary text.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from typing import Any

from llmcli.errors import LlmcliError

OPEN, CLOSE = "\ue0f0", "\ue0f1"  # private use: no template or tokenizer writes them


@dataclass(frozen=True)
class Guard:
    """The control tokens of one tokenizer and template, as patterns."""

    tokens: tuple[str, ...]
    token_pattern: re.Pattern[str]
    marked_pattern: re.Pattern[str]  # a marked token (group 1), or a lone marker


@functools.lru_cache(maxsize=32)
def _guard(added: tuple[tuple[str, bool], ...], template: str) -> Guard:
    tokens = tuple(
        sorted(
            {text for text, special in added if special or (text in template and not text.isspace())},
            key=len,
            reverse=True,  # longest first: `<|im_end|>` before a `<|im` that it contains
        )
    )
    alternatives = "|".join(map(re.escape, tokens)) or "(?!)"
    return Guard(
        tokens, re.compile(alternatives), re.compile(f"{OPEN}({alternatives}){CLOSE}|[{OPEN}{CLOSE}]")
    )


def guard_of(tokenizer: Any) -> Guard:
    decoder = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    added = {(token.content, bool(token.special)) for token in decoder.values()}
    added |= {(text, True) for text in getattr(tokenizer, "all_special_tokens", []) or []}
    template = str(getattr(tokenizer, "chat_template", "") or "")
    return _guard(tuple(sorted(added)), template)


def mark(value: Any, guard: Guard) -> Any:
    """`value` (a string, or lists and dicts of them: messages, tools) with each control token's
    text wrapped in markers. Markers already in the text are removed first, so none can be forged."""
    if isinstance(value, str):
        value = value.replace(OPEN, "").replace(CLOSE, "")
        return guard.token_pattern.sub(lambda found: f"{OPEN}{found.group(0)}{CLOSE}", value)
    if isinstance(value, dict):
        return {key: mark(item, guard) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [mark(item, guard) for item in value]
    return value


@dataclass(frozen=True)
class Prompt:
    """A rendered prompt: its pieces, each either markup or a control token's text that a user
    wrote (`as_text`). `text` is what the model reads, markers gone."""

    pieces: tuple[tuple[str, bool], ...]

    @property
    def text(self) -> str:
        return "".join(piece for piece, _ in self.pieces)

    def encode(self, tokenizer: Any, start: int = 0) -> list[int]:
        """Token ids of `text[start:]`."""
        ids: list[int] = []
        at = 0
        for piece, as_text in self.pieces:
            end = at + len(piece)
            if end > start:
                part = piece[max(0, start - at) :]
                at_start = at == 0 and start == 0
                if as_text:
                    ids += encode_as_text(tokenizer, part, at_start)
                elif len(self.pieces) == 1:
                    ids += _encode(tokenizer, part)  # nothing marked: the prompt tokenized whole
                else:
                    ids += _encode_markup(tokenizer, part, at_start)
            at = end
        return ids


def parse(rendered: str, guard: Guard) -> Prompt:
    """The pieces of a prompt rendered from marked values."""
    if OPEN not in rendered and CLOSE not in rendered:
        return Prompt(((rendered, False),))
    pieces: list[tuple[str, bool]] = []
    at = 0
    for found in guard.marked_pattern.finditer(rendered):
        if found.start() > at:
            pieces.append((rendered[at : found.start()], False))
        if found.group(1):
            pieces.append((found.group(1), True))
        at = found.end()
    if at < len(rendered):
        pieces.append((rendered[at:], False))
    return Prompt(tuple(pieces))


def _encode(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"]) if text else []


def _encode_markup(tokenizer: Any, text: str, at_start: bool) -> list[int]:
    """Ids for template text, as tokenizing the whole prompt would give them. In the middle of a
    prompt, text follows some token: it is encoded after a control token, whose id is dropped,
    so a SentencePiece-style tokenizer adds no prefix space (it adds one only at the start)."""
    anchor = None if at_start else _anchor(tokenizer)
    if anchor is None:
        return _encode(tokenizer, text)
    text_id, anchor_id = anchor
    ids = _encode(tokenizer, text_id + text)
    return ids[1:] if ids[:1] == [anchor_id] else _encode(tokenizer, text)


def _anchor(tokenizer: Any) -> tuple[str, int] | None:
    """A special token to encode markup after: one that is a single id and strips no whitespace
    around it (an `rstrip` token, as some of Phi-3's are, would eat the markup's leading newline)."""
    decoder = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    for token_id, token in sorted(decoder.items()):
        if not token.special or getattr(token, "lstrip", False) or getattr(token, "rstrip", False):
            continue
        if _encode(tokenizer, token.content) == [token_id]:
            return token.content, token_id
    return None


def encode_as_text(tokenizer: Any, text: str, at_start: bool = False) -> list[int]:
    """Ids for `text` read as plain text: no added token, special or not, is matched."""
    ids = _without_added_tokens(tokenizer, text, at_start)
    control = {tokenizer.convert_tokens_to_ids(token) for token in guard_of(tokenizer).tokens}
    if control & set(ids):  # the vocabulary itself spells this text as the control token
        message = f"this model's tokenizer reads {text!r} only as a control token: it cannot be sent as text"
        raise LlmcliError(message)
    return ids


def _without_added_tokens(tokenizer: Any, text: str, at_start: bool) -> list[int]:
    if not text:
        return []
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:  # not a `tokenizers` tokenizer: special tokens at least are split
        return list(tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"])
    # The backend's own pipeline, minus its added-token matching (which `split_special_tokens`
    # turns off only for special tokens).
    normalize = backend.normalizer.normalize_str if backend.normalizer is not None else str
    split = backend.pre_tokenizer.pre_tokenize_str if backend.pre_tokenizer is not None else None
    normalized = normalize(text)
    pieces = [piece for piece, _ in split(normalized)] if split else [normalized]
    if not at_start and split and pieces:
        # A SentencePiece-style pre-tokenizer prefixes the start of its input (with "▁");
        # in the middle of a prompt there is no start to mark.
        probe = normalize("a")
        prefix = split(probe)[0][0].removesuffix(probe)
        if prefix and pieces[0].startswith(prefix) and not normalized.startswith(prefix):
            pieces[0] = pieces[0][len(prefix) :]
    return [token.id for piece in pieces if piece for token in backend.model.tokenize(piece)]
