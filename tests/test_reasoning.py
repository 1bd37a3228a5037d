"""Reasoning models: thinking recognised from the template, split from the answer as it streams,
kept off stdout, reported in --json and by the server, and switched off through the template."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from llmcli.engine.reasoning import (
    CONTENT,
    HARMONY,
    REASONING,
    THINK_FORMATS,
    ThinkSplitter,
    reasoning_tokens,
    thinking_of,
)

from cli_helpers import PATIENCE_S, run_cli

THINK = THINK_FORMATS[0]
# A DeepSeek-R1-distill-style template (the generation prompt opens the block) with Qwen3's
# switch: enable_thinking=false writes an empty block instead.
THINKING_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{% if enable_thinking is defined and enable_thinking is false %}{{ '<think>\\n\\n</think>\\n\\n' }}"
    "{% else %}{{ '<think>\\n' }}{% endif %}{% endif %}"
)


def split(text: str, inside: bool, cuts: list[int], think=THINK) -> dict[str, str]:
    splitter = ThinkSplitter(think, inside)
    pieces, start = [], 0
    for cut in [*cuts, len(text)]:
        pieces += splitter.feed(text[start:cut])
        start = cut
    pieces += splitter.flush()
    joined = {REASONING: "", CONTENT: ""}
    for channel, piece in pieces:
        joined[channel] += piece
    return joined


@pytest.mark.parametrize(
    ("text", "inside", "reasoning", "answer"),
    [
        ("I should add.</think>\n\nIt is 4.", True, "I should add.", "It is 4."),
        ("<think>\nHmm.\n</think>\n\nParis.", False, "\nHmm.\n", "Paris."),
        ("  <think>x</think>y", False, "x", "y"),
        ("No thinking here.", False, "", "No thinking here."),
        ("<thing> is not a marker", False, "", "<thing> is not a marker"),
        ("still thinking, cut short", True, "still thinking, cut short", ""),
        ("a < b and </thin is not the end</think>ok", True, "a < b and </thin is not the end", "ok"),
    ],
)
def test_thinking_and_answer_split_wherever_the_pieces_break(text, inside, reasoning, answer) -> None:
    for cuts in ([], *[[i] for i in range(1, len(text))], list(range(1, len(text)))):
        assert split(text, inside, cuts) == {REASONING: reasoning, CONTENT: answer}, cuts


def test_thinking_is_recognised_from_the_template_not_the_name(loaded_tiny) -> None:
    tokenizer = loaded_tiny.tokenizer
    assert thinking_of(tokenizer) is None  # ChatML without think tags
    original = tokenizer.chat_template
    try:
        tokenizer.chat_template = THINKING_TEMPLATE
        thinking = thinking_of(tokenizer)
        assert thinking is not None and thinking.format == THINK and thinking.switchable
        tokenizer.chat_template = THINKING_TEMPLATE.replace("enable_thinking", "thoughts_on")
        assert not thinking_of(tokenizer).switchable
    finally:
        tokenizer.chat_template = original


def test_reasoning_tokens_count_up_to_the_end_marker() -> None:
    words = ["Let", " me", " think", "</think>", "\n\n", "Yes"]

    def decode(ids: list[int]) -> str:
        return "".join(words[i] for i in ids)

    assert reasoning_tokens(decode, list(range(6)), THINK, inside=True) == 4
    assert reasoning_tokens(decode, [0, 1, 2], THINK, inside=True) == 3  # never ended: all of it
    assert reasoning_tokens(decode, [5], THINK, inside=False) == 0


@pytest.fixture(scope="module")
def thinking_model(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import AutoTokenizer

    folder = tmp_path_factory.mktemp("models") / "tiny-thinking"
    shutil.copytree(tiny_llama, folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.chat_template = THINKING_TEMPLATE
    tokenizer.save_pretrained(folder)
    return folder


def generate(model: Path, *args: str, env: dict[str, str] | None = None):
    return run_cli("generate", "-m", str(model), "--device", "cpu", "-t", "0", "-n", "12", *args, env=env)


def test_generate_keeps_thinking_off_stdout(thinking_model: Path) -> None:
    record = json.loads(generate(thinking_model, "--json", "Hello").stdout)
    assert record["reasoning"] and "<think>" not in record["text"] and "<think>" not in record["reasoning"]
    # The random model never closes the block it was put in: every token is thinking.
    assert record["reasoning_tokens"] == record["completion_tokens"] == 12
    hidden = generate(thinking_model, "--think", "hide", "Hello")
    assert hidden.returncode == 0 and hidden.stdout == b"" and hidden.stderr == b""
    shown = generate(thinking_model, "--think", "show", "Hello")
    assert shown.returncode == 0 and shown.stdout == b""
    assert record["reasoning"].strip() in shown.stderr.decode()  # dimmed on stderr, not stdout


def test_think_off_reaches_the_template(thinking_model: Path) -> None:
    off = json.loads(generate(thinking_model, "--json", "--think", "off", "Hello").stdout)
    on = json.loads(generate(thinking_model, "--json", "Hello").stdout)
    assert off["reasoning"] is None and off["reasoning_tokens"] == 0 and off["text"]
    assert off["prompt_tokens"] > on["prompt_tokens"]  # the empty block the template writes
    config_off = generate(thinking_model, "--json", "Hello", env={"LLMCLI_THINK": "off"})
    assert json.loads(config_off.stdout)["text"] == off["text"]
    bad = generate(thinking_model, "--think", "maybe", "Hello")
    assert bad.returncode == 2 and b"--think must be one of show, hide, off" in bad.stderr


def test_the_server_gives_reasoning_content(thinking_model: Path, tmp_path: Path) -> None:
    import signal

    import openai

    from test_serve import start_server

    server = start_server(thinking_model, tmp_path)
    try:
        client = server.client()
        asked = {"model": "tiny", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 12}
        reply = client.chat.completions.create(**asked, temperature=0)
        message = reply.choices[0].message
        assert message.model_extra["reasoning_content"] and message.content == ""
        assert reply.usage.completion_tokens_details.reasoning_tokens == reply.usage.completion_tokens
        streamed = "".join(
            (chunk.choices[0].delta.model_extra or {}).get("reasoning_content") or ""
            for chunk in client.chat.completions.create(**asked, temperature=0, stream=True)
            if chunk.choices
        )
        assert streamed == message.model_extra["reasoning_content"]
        off = client.chat.completions.create(
            **asked, temperature=0, extra_body={"chat_template_kwargs": {"enable_thinking": False}}
        )
        assert off.choices[0].message.content and off.usage.completion_tokens_details.reasoning_tokens == 0
        with pytest.raises(openai.BadRequestError, match="does not read reasoning_effort"):
            client.chat.completions.create(**asked, reasoning_effort="low")
    finally:
        server.process.send_signal(signal.SIGTERM)
        server.process.wait(timeout=PATIENCE_S)


def test_a_thinking_chat_keeps_its_cache_and_its_switch(thinking_model: Path) -> None:
    script = b"Hello\nAnd again\n/think off\nOnce more\n"
    proc = run_cli(
        "chat", "-m", str(thinking_model), "--device", "cpu", "-t", "0", "-n", "6", "--json", stdin=script
    )
    assert proc.returncode == 0, proc.stderr.decode()
    turns = [json.loads(line) for line in proc.stdout.splitlines()]
    assert [bool(turn["reasoning"]) for turn in turns] == [True, True, False]
    assert turns[0]["reply"] == "" and turns[2]["reply"]  # thinking stays out of the reply
    assert turns[1]["cached_tokens"] >= turns[0]["prompt_tokens"]  # the first turn, reused exactly
    assert "think off" in proc.stderr.decode()


def test_a_thinking_budget_ends_the_thinking_and_the_answer_follows(
    thinking_model: Path, loaded_tiny
) -> None:
    marker = len(loaded_tiny.tokenizer(THINK.end, add_special_tokens=False)["input_ids"])
    proc = generate(thinking_model, "--json", "--think-budget", "4", "-n", "24", "Hello")
    assert proc.returncode == 0, proc.stderr.decode()
    record = json.loads(proc.stdout)
    assert record["reasoning_tokens"] == 4 + marker  # the budget, then the end marker written for it
    assert record["text"] and record["completion_tokens"] == 24
    refused = generate(thinking_model, "--think-budget", "4", "--speculative", "lookup", "Hello")
    assert refused.returncode == 2 and b"do not combine" in refused.stderr


def test_a_schema_constrains_the_answer_after_the_thinking(thinking_model: Path) -> None:
    schema = '{"enum": ["yes", "no"]}'
    proc = generate(
        thinking_model, "--json", "--think-budget", "3", "--json-schema", schema, "-n", "30", "Hi"
    )
    assert proc.returncode == 0, proc.stderr.decode()
    record = json.loads(proc.stdout)
    assert record["reasoning"] and record["value"] in ("yes", "no")  # it thought freely, then answered


def test_thinking_options_a_model_cannot_honour_are_refused(tiny_llama: Path, thinking_model: Path) -> None:
    budget = generate(tiny_llama, "--think-budget", "4", "Hello")  # ChatML: no thinking to bound
    assert budget.returncode == 2 and b"needs a model that thinks" in budget.stderr
    raw = generate(thinking_model, "--raw", "--think", "off", "Hello")
    assert raw.returncode == 2 and b"--think off asks the chat template" in raw.stderr


HARMONY_TEXTS = [
    (
        "<|channel|>analysis<|message|>User wants 2+2.<|end|>"
        "<|start|>assistant<|channel|>final<|message|>It is 4.",
        False,
        "User wants 2+2.",
        "It is 4.",
    ),
    ("<|channel|>final<|message|>Paris.", False, "", "Paris."),
    ("Plain answer, no channel.", False, "", "Plain answer, no channel."),
    ("cut short in the analysis", True, "cut short in the analysis", ""),
    (
        "a <|end of nothing|> here<|end|><|start|>assistant<|channel|>final<|message|>\n\nok",
        True,
        "a <|end of nothing|> here",
        "ok",
    ),
]


@pytest.mark.parametrize(("text", "inside", "reasoning", "answer"), HARMONY_TEXTS)
def test_harmony_channels_split_into_thinking_and_answer_wherever_the_pieces_break(
    text, inside, reasoning, answer
) -> None:
    """gpt-oss: the analysis channel is thinking, the final channel's header is framing."""
    for cuts in ([], *[[i] for i in range(1, len(text))]):
        assert split(text, inside, cuts, HARMONY) == {REASONING: reasoning, CONTENT: answer}, cuts


# gpt-oss's harmony layout, cut down: earlier answers in the final channel, and a generation
# prompt that opens the analysis channel (so that a random model is thinking from its first token).
HARMONY_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}{{ '<|start|>assistant<|channel|>final<|message|>' }}"
    "{% else %}{{ '<|start|>' + message['role'] + '<|message|>' }}{% endif %}"
    "{{ message['content'] + '<|end|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start|>assistant<|channel|>analysis<|message|>' }}{% endif %}"
)
HARMONY_TOKENS = ("<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>")


@pytest.fixture(scope="module")
def harmony_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tiny_models import build_tiny_model

    folder = tmp_path_factory.mktemp("models") / "tiny-gpt-oss"
    return build_tiny_model(folder, "gpt_oss", chat_template=HARMONY_TEMPLATE, special=HARMONY_TOKENS)


def test_a_gpt_oss_model_runs_natively_and_its_analysis_channel_is_reasoning(harmony_model: Path) -> None:
    """The markers are special tokens: kept in the reply's text for the split, never shown. A
    budget writes `<|end|>` (one token) and the answer follows; a chat keeps the answers alone,
    and its cache up to where the template rewrites the last reply."""
    record = json.loads(generate(harmony_model, "--json", "Hello").stdout)
    assert record["engine"] == "native"
    assert record["reasoning"] and record["reasoning_tokens"] == record["completion_tokens"] == 12
    budget = generate(harmony_model, "--json", "--think-budget", "4", "-n", "16", "Hello")
    assert budget.returncode == 0, budget.stderr.decode()
    bounded = json.loads(budget.stdout)
    assert bounded["reasoning_tokens"] == 5 and bounded["text"]
    assert "<|end|>" not in bounded["reasoning"] + bounded["text"]
    off = json.loads(generate(harmony_model, "--json", "--think", "off", "Hello").stdout)
    assert off["reasoning"] is None and off["text"]  # an empty analysis, then the final channel
    script = b"Hello\nAnd again\n"
    chat = run_cli(
        "chat", "-m", str(harmony_model), "--device", "cpu", "-t", "0", "-n", "6", "--think-budget", "2",
        "--json", stdin=script,
    )  # fmt: skip
    assert chat.returncode == 0, chat.stderr.decode()
    turns = [json.loads(line) for line in chat.stdout.splitlines()]
    assert len(turns) == 2 and all(turn["reasoning"] for turn in turns)
    # The first turn reused up to its answer's channel: the template writes earlier answers in
    # the final channel, without their analysis (as gpt-oss's own does).
    from transformers import AutoTokenizer

    channel = AutoTokenizer.from_pretrained(harmony_model)("analysis<|message|>", add_special_tokens=False)
    assert turns[1]["cached_tokens"] == turns[0]["prompt_tokens"] - len(channel["input_ids"])
