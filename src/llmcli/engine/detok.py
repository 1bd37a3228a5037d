"""Token ids → text, one token at a time, safe for UTF-8 split across tokens; stop strings.

Byte-level tokenizers cut multi-byte characters (emoji, CJK) across tokens, so decoding the newest
token alone shows U+FFFD. We decode a sliding window of recent tokens instead and show the part of
its text not shown yet, up to any trailing U+FFFD: that is a character still being completed, held
until the next token finishes it. Unlike transformers' TextIteratorStreamer, nothing waits for
whitespace: every character is shown as soon as it is complete.
"""

from __future__ import annotations

from typing import Any

_INCOMPLETE = "\ufffd"
# Tokens kept before the newest ones, so that tokenizers whose rendering of a token depends on the
# one before it (SentencePiece's leading-space rule) decode the window as the full decode would.
_CONTEXT_TOKENS = 4


def decode_exact(tokenizer: Any, ids: list[int]) -> str:
    """Text of `ids` with special tokens and spacing exactly as the template writes them."""
    return tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self.ids: list[int] = []
        self._window_start = 0  # decoding starts at this token: cost stays O(window), not O(text)
        self._shown_in_window = 0  # characters of the window's text already returned
        self._emitted_text = ""

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special)

    def push(self, token_id: int) -> str:
        """Add one token; return the text it completes ('' while a character is still partial)."""
        self.ids.append(token_id)
        text = self._decode(self.ids[self._window_start :])
        complete = text.rstrip(_INCOMPLETE)
        piece = complete[self._shown_in_window :]
        self._shown_in_window = max(self._shown_in_window, len(complete))
        if complete == text and len(self.ids) - self._window_start > 2 * _CONTEXT_TOKENS:
            # Nothing pending: slide the window forward, keeping a few tokens of context.
            self._window_start = len(self.ids) - _CONTEXT_TOKENS
            self._shown_in_window = len(self._decode(self.ids[self._window_start :]))
        self._emitted_text += piece
        return piece

    def flush(self, cut: bool = False) -> str:
        """The rest of the text at the end of generation.

        The full decode is the reference: whatever it has beyond what was emitted comes out now,
        including a U+FFFD for a character the model itself never finished. `cut`: the length
        limit ended it, and a character it cut in its middle is dropped instead (its tokens
        still count as generated).
        """
        full = self.text()
        rest = full[len(self._emitted_text) :] if full.startswith(self._emitted_text) else ""
        if cut:
            rest = rest.rstrip("\ufffd")
        self._emitted_text += rest
        return rest

    def text(self) -> str:
        return self._decode(self.ids)


class StopMatcher:
    """Finds stop strings in streamed text; never lets any part of one reach the output.

    Text that could be the start of a stop string is held back until the next piece shows
    whether it is one.
    """

    def __init__(self, stop_strings: tuple[str, ...]) -> None:
        self._stops = tuple(s for s in stop_strings if s)
        self._held = ""
        self.stopped = False
        self.matched: str | None = None  # the stop string that ended the text (the first in it)

    def feed(self, piece: str) -> str:
        """Text that is safe to show now. Sets `stopped` when a stop string completes."""
        if not self._stops:
            return piece
        text = self._held + piece
        hits = [(at, stop) for stop in self._stops if (at := text.find(stop)) >= 0]
        if hits:
            at, self.matched = min(hits, key=lambda hit: hit[0])
            self.stopped = True
            self._held = ""
            return text[:at]
        keep = self._longest_partial_stop(text)
        self._held = text[len(text) - keep :] if keep else ""
        return text[: len(text) - keep]

    def flush(self) -> str:
        """At the end without a stop: the held text was not a stop string after all."""
        held, self._held = self._held, ""
        return held

    def _longest_partial_stop(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of some stop string."""
        longest = 0
        for stop in self._stops:
            for length in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:length]):
                    longest = length
                    break
        return longest
