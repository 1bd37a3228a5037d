"""Beam search (`generate --num-beams N`) equals transformers' `generate(num_beams=N,
do_sample=False)` on the same model and prompt, through the CLI, with and without a stop string."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from llmcli.config.settings import SamplingParams

from cli_helpers import run_cli

PROMPT = "Tell me about the sea"
NEW_TOKENS = 20


@pytest.fixture(scope="module")
def reference(loaded_tiny):
    return searcher(loaded_tiny)


def searcher(loaded):
    """transformers' beam search on the tiny model llmcli loaded, from the very prompt ids."""
    from llmcli.engine.conversation import build_messages, prompt_ids

    model, tokenizer = loaded.model, loaded.tokenizer
    ids = prompt_ids(tokenizer, build_messages(PROMPT))

    def search(beams: int, stop: str | None = None) -> tuple[list[int], str]:
        """The winner's tokens and its whole text (a stop string in it not cut yet)."""
        input_ids = torch.tensor([ids])
        options = {"stop_strings": [stop], "tokenizer": tokenizer} if stop else {}
        with torch.inference_mode():
            out = model.generate(
                input_ids,
                attention_mask=torch.ones_like(input_ids),
                num_beams=beams,
                do_sample=False,
                max_new_tokens=NEW_TOKENS,
                **options,
            )
        tokens = out[0, len(ids) :].tolist()
        return tokens, tokenizer.decode(tokens, skip_special_tokens=True)

    return search


def beams_through_the_cli(model: Path, beams: int, *extra: str) -> dict:
    proc = run_cli(
        "generate", "-m", str(model), "--device", "cpu", "--num-beams", str(beams), "-n", str(NEW_TOKENS),
        "--json", *extra, PROMPT,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr.decode()
    assert proc.stderr == b""  # no library warnings either
    return json.loads(proc.stdout)


@pytest.mark.parametrize("beams", [2, 4])
def test_beam_search_equals_transformers(loaded_tiny, reference, beams: int) -> None:
    from llmcli.engine.beams import beam_search
    from llmcli.engine.conversation import build_messages, prompt_ids

    ids = prompt_ids(loaded_tiny.tokenizer, build_messages(PROMPT))
    params = SamplingParams(temperature=0.0, max_new_tokens=NEW_TOKENS)
    tokens, text = reference(beams)
    got = beam_search(loaded_tiny, ids, params, beams)
    # Cut by the length limit: a character cut in its middle is dropped, as everywhere.
    assert (got.token_ids, got.text, got.finish_reason) == (tokens, text.rstrip("\ufffd"), "length")
    # The stop string: a piece from the middle of that reply, so the search meets it.
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    assert stop.strip() and stop in text
    tokens, whole = reference(beams, stop)
    stopped = beam_search(loaded_tiny, ids, params.with_(stop=(stop,)), beams)
    assert stopped.text == whole.split(stop)[0] and stopped.token_ids == tokens
    # transformers ends a beam at a stop string as at end-of-sequence, and that beam then competes
    # on its score: the stop either cuts the winner short or makes another beam win.
    assert whole != text
    ended = len(tokens) < NEW_TOKENS or stop in whole
    assert stopped.finish_reason == ("stop" if ended else "length")


def test_beams_through_the_cli(tiny_llama: Path) -> None:
    """The prompt through the chat template, the text, the fields, nothing on stderr."""
    from llmcli.config.settings import LoadSettings
    from llmcli.models.load import load_model
    from llmcli.models.resolve import resolve_model

    loaded = load_model(resolve_model(str(tiny_llama)), LoadSettings(device="cpu", threads=1))
    tokens, text = searcher(loaded)(4)
    got = beams_through_the_cli(tiny_llama, 4)
    assert got["text"] == text and got["completion_tokens"] == len(tokens) and got["num_beams"] == 4
    greedy = beams_through_the_cli(tiny_llama, 1, "-t", "0")
    assert greedy["text"] != text  # four beams choose another reply than greedy decoding here


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--num-beams", "0"], "--num-beams must be in 1…64"),
        (["--num-beams", "2", "--speculative", "lookup"], "--num-beams and --speculative do not combine"),
        (["--num-beams", "2", "--server", "http://127.0.0.1:9"], "cannot go through --server"),
    ],
)
def test_beam_usage_errors(tiny_llama: Path, args: list[str], message: str) -> None:
    proc = run_cli("generate", "-m", str(tiny_llama), *args, "hi")
    assert proc.returncode == 2 and message in proc.stderr.decode()
    assert len(proc.stderr.decode().strip().splitlines()) == 1
