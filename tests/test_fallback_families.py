"""Families only transformers runs, whose cache layers cannot all be cropped back: a recurrent
state (Nemotron-H's Mamba-2), a short convolution's (LFM2), KV shared from other layers (Gemma
3n), a sliding window shorter than the prompt (OLMo 3). (Those the native engine runs have tests
of their own: Qwen3.5 in test_qwen35*.py, Gemma 4 in test_gemma4.py.) generate, a chat and a
server reply exactly what transformers' own `generate` does, greedy in fp32; where a new prompt
would need the cache cropped back, it starts empty and says so (0 cached tokens), never a crash
or a 500."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from llmcli.engine.conversation import Conversation, build_messages, prompt_ids

from cli_helpers import run_cli
from test_serve import Server, served
from tiny_models import FALLBACK_FAMILIES, TINY_CONTEXT, build_tiny_model, runs_natively_by_default

REPLY_TOKENS = 10
# Each longer than OLMo 3's window (4 positions), the second not extending the first.
PROMPTS = ["Hello there, how are you today?", "What is the capital of France?"]
GREEDY = ["--device", "cpu", "-t", "0", "-n", str(REPLY_TOKENS), "--json"]


# State that cannot be cropped back, one family of each kind through the commands (each costs
# processes; the last test checks every family in process): Mamba-2, shared KV.
STATEFUL = [arch for arch in ["nemotron_h", "gemma3n_text"] if not runs_natively_by_default(arch)]
FALLBACK_ONLY = sorted(arch for arch in FALLBACK_FAMILIES if not runs_natively_by_default(arch))
# A window full: a crop needs the positions it has let go. A one-shot reply never crops.
WINDOWED = ["olmo3"]


@pytest.fixture(scope="module")
def family(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("models") / request.param, request.param)


class Reference:
    """The family loaded by transformers alone: its own `generate`, greedy, in fp32."""

    def __init__(self, folder: Path) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(folder)
        self.model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        self.eos = self.tokenizer.convert_tokens_to_ids("<|im_end|>")

    def reply(self, ids: list[int]) -> tuple[str, list[int], str]:
        """The text, the token ids (end of sequence included) and why it ended."""
        with torch.inference_mode():
            out = self.model.generate(
                torch.tensor([ids]),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                do_sample=False,
                max_new_tokens=REPLY_TOKENS,
                eos_token_id=self.eos,
                pad_token_id=self.tokenizer.pad_token_id,
            )
        new = out[0, len(ids) :].tolist()
        finish = "stop" if new[-1] == self.eos else "length"
        text = self.tokenizer.decode([t for t in new if t != self.eos], skip_special_tokens=True)
        # A character the length limit cut in its middle is dropped, not shown as U+FFFD.
        return (text.rstrip("\ufffd") if finish == "length" else text), new, finish

    def answer(self, prompt: str) -> str:
        return self.reply(prompt_ids(self.tokenizer, build_messages(prompt)))[0]

    def chat(self, messages: list[str]) -> list[str]:
        """A chat's replies, each turn's prompt built as llmcli's chat builds it."""
        conversation, replies = Conversation(self.tokenizer, TINY_CONTEXT), []
        for message in messages:
            prompt, dropped = conversation.prompt_for(message, REPLY_TOKENS)
            text, ids, finish = self.reply(prompt)
            conversation.commit(message, prompt, dropped, text, ids, finish)
            replies.append(text)
        return replies


@pytest.fixture(scope="module")
def reference(family: Path) -> Reference:
    return Reference(family)


@pytest.mark.parametrize("family", STATEFUL, indirect=True)
def test_generate_prints_the_reply_and_its_record(family: Path, reference: Reference) -> None:
    proc = run_cli("generate", "-m", str(family), *GREEDY, PROMPTS[0])
    assert proc.returncode == 0, proc.stderr.decode()
    record = json.loads(proc.stdout)
    assert record["engine"] == "transformers"
    assert record["text"] == reference.answer(PROMPTS[0]) and record["text"]


@pytest.mark.parametrize("family", STATEFUL + WINDOWED, indirect=True)
def test_a_chat_reuses_what_it_can_and_starts_over_elsewhere(family: Path, reference: Reference) -> None:
    """The second turn extends the first: its cache is reused as it is, a state included. /undo
    takes the cache back before that second turn: what cannot go back starts empty."""
    script = f"{PROMPTS[0]}\n{PROMPTS[1]}\n/undo\nAnd of Italy?\n".encode()
    proc = run_cli("chat", "-m", str(family), *GREEDY, stdin=script)
    assert proc.returncode == 0, proc.stderr.decode()
    turns = [json.loads(line) for line in proc.stdout.decode().splitlines()]
    first, second = reference.chat(PROMPTS), reference.chat([PROMPTS[0], "And of Italy?"])
    assert [turn["reply"] for turn in turns] == [*first, second[1]]
    assert turns[1]["cached_tokens"] >= turns[0]["prompt_tokens"]
    assert turns[2]["cached_tokens"] == 0
    for turn in turns:
        assert turn["prompt_tokens"] == turn["prefilled_tokens"] + turn["cached_tokens"]


@pytest.fixture(scope="module")
def server(family: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    yield from served(family, tmp_path_factory.mktemp("runtime"))


def ask(server: Server, prompt: str) -> Any:
    return server.client().chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": prompt}], max_tokens=REPLY_TOKENS, temperature=0
    )


@pytest.mark.parametrize("family", STATEFUL + WINDOWED, indirect=True)
def test_a_server_answers_prompts_that_do_not_extend_the_last(server: Server, reference: Reference) -> None:
    for prompt in [*PROMPTS, PROMPTS[0]]:
        reply = ask(server, prompt)
        assert reply.choices[0].message.content == reference.answer(prompt)
        # Each shares the chat template's first tokens with the last, and none can be kept.
        assert reply.usage.prompt_tokens_details.cached_tokens == 0


@pytest.mark.parametrize("arch", FALLBACK_ONLY)
def test_every_fallback_family_replies_as_transformers_does_prompt_after_prompt(
    arch: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """In process, so every family is cheap to check: one engine, prompts that do not extend one
    another, each reply transformers' own and none reusing a cache that cannot go back."""
    from llmcli.config.settings import LoadSettings, SamplingParams
    from llmcli.engine.loop import Engine
    from llmcli.models.load import load_model
    from llmcli.models.resolve import resolve_model

    folder = build_tiny_model(tmp_path_factory.mktemp("models") / arch, arch)
    loaded = load_model(resolve_model(str(folder)), LoadSettings(device="cpu", dtype="fp32", threads=1))
    engine, reference = Engine.for_loaded(loaded), Reference(folder)
    assert engine.name == "transformers"
    for prompt in [*PROMPTS, PROMPTS[0]]:
        ids = prompt_ids(loaded.tokenizer, build_messages(prompt))
        result = engine.complete(
            ids, SamplingParams(temperature=0.0, max_new_tokens=REPLY_TOKENS), loaded.tokenizer
        )
        assert result.text == reference.answer(prompt)
        assert result.stats.cached_tokens == 0
