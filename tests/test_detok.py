"""Incremental detokenizing of split multi-byte characters, and stop strings with hold-back."""

from __future__ import annotations

import pytest

from llmcli.engine.detok import IncrementalDetokenizer, StopMatcher

TEXTS = [
    "Emoji split across tokens: 😀 🎉 🚀 👍🏽 and a family 👨‍👩‍👧.",
    "你好，世界。今天天气很好。こんにちは、世界。",
    "Mixed: café 😀 naïve 日本語 end",
    "Plain ASCII text with spaces and\nnewlines\n\n  indented",
    " Leading space, then characters never seen in training: 🦀 龍 Ω ∑",
]


@pytest.fixture(scope="module", params=["bytelevel", "metaspace"])
def tokenizer(request: pytest.FixtureRequest):
    from tiny_models import train_tokenizer

    return train_tokenizer(style=request.param)


@pytest.mark.parametrize("text", TEXTS)
def test_streamed_text_is_complete_prompt_and_never_shows_a_replacement_char(tokenizer, text: str) -> None:
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    detok = IncrementalDetokenizer(tokenizer)
    shown = ""
    split_characters = 0
    for i, token_id in enumerate(ids):
        piece = detok.push(token_id)
        assert "\ufffd" not in piece
        shown += piece
        # Every complete character is shown at once: nothing waits for whitespace.
        so_far = tokenizer.decode(ids[: i + 1])
        complete = so_far.rstrip("\ufffd")
        split_characters += so_far != complete
        assert shown == complete
    shown += detok.flush()
    assert shown == tokenizer.decode(ids)
    if "never seen" in text:  # both tokenizers must fall back to bytes here
        assert split_characters > 0, "the test text should split some character across tokens"


def test_an_unfinished_character_comes_out_at_the_end(tokenizer) -> None:
    ids = tokenizer("ok 🦀", add_special_tokens=False)["input_ids"]  # unseen: split into bytes
    detok = IncrementalDetokenizer(tokenizer)
    shown = "".join(detok.push(t) for t in ids[:-1])
    assert "\ufffd" not in shown
    rest = detok.flush()
    assert shown + rest == tokenizer.decode(ids[:-1])
    assert rest.endswith("\ufffd")


def feed_all(matcher: StopMatcher, pieces: list[str]) -> str:
    out = ""
    for piece in pieces:
        out += matcher.feed(piece)
        if matcher.stopped:
            return out
    return out + matcher.flush()


@pytest.mark.parametrize(
    ("pieces", "stops", "expected", "stopped"),
    [
        (["Hello wo", "rld, bye"], ("world",), "Hello ", True),
        (["ab", "c", "d", "ef"], ("cde",), "ab", True),
        (["x\n", "\ny"], ("\n\n",), "x", True),
        (["nothing ", "to see"], ("stop",), "nothing to see", False),
        (["partial st", "ill not"], ("stop",), "partial still not", False),
        (["ends with st"], ("stop",), "ends with st", False),
        (["two ", "END", "two"], ("TWO", "END"), "two ", True),
        (["first", " STOP then ", "END"], ("END", "STOP"), "first ", True),
    ],
)
def test_stop_strings(pieces: list[str], stops: tuple[str, ...], expected: str, stopped: bool) -> None:
    matcher = StopMatcher(stops)
    assert feed_all(matcher, pieces) == expected
    assert matcher.stopped is stopped


def test_text_that_may_start_a_stop_string_is_held_back() -> None:
    matcher = StopMatcher(("<end>",))
    assert matcher.feed("answer <e") == "answer "
    assert matcher.feed("nd") == ""
    assert matcher.feed("ing") == "<ending"
    assert not matcher.stopped
