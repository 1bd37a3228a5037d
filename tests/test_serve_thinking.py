"""A reasoning model's thinking through each protocol the server speaks: Anthropic's thinking
blocks (with a budget), the Responses API's reasoning item, Ollama's `thinking` — apart from
the answer, streamed and not."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from test_reasoning import thinking_model  # noqa: F401 - the fixture

from cli_helpers import PATIENCE_S
from test_serve import Server, assert_access_log_only, start_server

anthropic = pytest.importorskip("anthropic")
ollama = pytest.importorskip("ollama")

ASK = [{"role": "user", "content": "Is 7 prime?"}]


@pytest.fixture(scope="module")
def server(thinking_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:  # noqa: F811
    running = start_server(thinking_model, tmp_path_factory.mktemp("runtime"))
    yield running
    running.process.send_signal(signal.SIGTERM)
    assert running.process.wait(timeout=PATIENCE_S) == 0
    assert_access_log_only(running.process.stderr.read())


def test_anthropic_thinking_blocks_come_before_the_answer_and_keep_to_the_budget(server: Server) -> None:
    client = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)
    asked = dict(
        model="tiny", messages=ASK, max_tokens=16, thinking={"type": "enabled", "budget_tokens": 4},
        extra_body={"temperature": 0},
    )  # fmt: skip
    message = client.messages.create(**asked)
    assert [block.type for block in message.content] == ["thinking", "text"]
    assert message.content[0].thinking and "</think>" not in message.content[1].text
    with client.messages.stream(**asked) as stream:
        streamed = stream.get_final_message()
    assert [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None)) for b in streamed.content] == [
        (b.type, getattr(b, "thinking", None) or getattr(b, "text", None)) for b in message.content
    ]


def test_the_responses_api_gives_thinking_as_a_reasoning_item(server: Server) -> None:
    response = server.client().responses.create(
        model="tiny", input="Is 7 prime?", max_output_tokens=10, temperature=0
    )
    assert response.output[0].type == "reasoning" and response.output[0].summary[0].text
    assert response.usage.output_tokens_details.reasoning_tokens > 0
    with server.client().responses.stream(
        model="tiny", input="Is 7 prime?", max_output_tokens=10, temperature=0
    ) as s:
        final = s.get_final_response()
    assert final.output[0].summary[0].text == response.output[0].summary[0].text


def test_ollama_gives_thinking_apart_and_think_false_turns_it_off(server: Server) -> None:
    client = ollama.Client(host=server.url)
    options = {"temperature": 0, "num_predict": 10}
    thought = client.chat(model="tiny", messages=ASK, options=options)
    assert thought.message.thinking and "<think>" not in (thought.message.content or "")
    streamed = list(client.chat(model="tiny", messages=ASK, options=options, stream=True))
    assert "".join(part.message.thinking or "" for part in streamed) == thought.message.thinking
    plain = client.chat(model="tiny", messages=ASK, options=options, think=False)
    assert not plain.message.thinking and plain.message.content
