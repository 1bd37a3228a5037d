"""Tool calls through `llmcli serve`, read by the official `openai` client: calls that parse and
validate (streamed and not), a tool result's turn, and every bad input a 400 that says why."""

from __future__ import annotations

import json
import signal
from collections.abc import Iterator

import pytest

from test_serve import Server, start_server
from tiny_models import build_tiny_model
from tool_templates import ADDED, HERMES_TEMPLATE, SPECIAL, TOOLS, WEATHER

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")

ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
SCHEMAS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    folder = tmp_path_factory.mktemp("models") / "tiny-hermes"
    build_tiny_model(folder, "llama", chat_template=HERMES_TEMPLATE, added=ADDED, special=SPECIAL)
    running = start_server(folder, tmp_path_factory.mktemp("runtime"))
    yield running
    running.process.send_signal(signal.SIGTERM)
    assert running.process.wait(timeout=30) == 0
    assert running.process.stderr.read() == b""


def valid(call) -> bool:
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    return call.type == "function" and call.id.startswith("call_")


def test_required_calls_parse_validate_and_stream_as_openai_streams_them(server: Server) -> None:
    client = server.client()
    asked = dict(
        model="tiny", messages=ASK, tools=TOOLS, tool_choice="required", temperature=0, max_tokens=200
    )
    whole = client.chat.completions.create(**asked, parallel_tool_calls=False)
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert len(choice.message.tool_calls) == 1 and valid(choice.message.tool_calls[0])
    # The SDK's stream helper reassembles the streamed call: the same call, greedy.
    with client.chat.completions.stream(**asked, parallel_tool_calls=False) as stream:
        final = stream.get_final_completion()
    streamed = final.choices[0].message.tool_calls
    assert [(c.function.name, c.function.arguments) for c in streamed] == [
        (c.function.name, c.function.arguments) for c in choice.message.tool_calls
    ]
    assert final.choices[0].finish_reason == "tool_calls"


def test_a_named_function_is_the_one_called_and_none_calls_nothing(server: Server) -> None:
    client = server.client()
    named = {"type": "function", "function": {"name": "convert_units"}}
    for seed in range(3):
        reply = client.chat.completions.create(
            model="tiny", messages=ASK, tools=TOOLS, tool_choice=named, seed=seed, max_tokens=200,
            parallel_tool_calls=False,
        )  # fmt: skip
        calls = reply.choices[0].message.tool_calls
        assert [c.function.name for c in calls] == ["convert_units"] and valid(calls[0])
        nothing = client.chat.completions.create(
            model="tiny", messages=ASK, tools=TOOLS, tool_choice="none", seed=seed, max_tokens=20
        )
        assert not nothing.choices[0].message.tool_calls and nothing.choices[0].finish_reason != "tool_calls"


def test_auto_never_returns_a_malformed_call(server: Server) -> None:
    client = server.client()
    for seed in range(4):
        reply = client.chat.completions.create(
            model="tiny", messages=ASK, tools=TOOLS, seed=seed, max_tokens=60
        )
        message = reply.choices[0].message
        assert all(valid(call) for call in message.tool_calls or [])
        assert "<tool_call>" not in (message.content or "")


def test_a_tool_result_turn_is_answered(server: Server) -> None:
    client = server.client()
    first = client.chat.completions.create(
        model="tiny", messages=ASK, tools=TOOLS, tool_choice="required", temperature=0, max_tokens=200,
        parallel_tool_calls=False,
    )  # fmt: skip
    call = first.choices[0].message.tool_calls[0]
    history = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "18 degrees and clear"},
    ]
    reply = client.chat.completions.create(model="tiny", messages=history, tools=TOOLS, max_tokens=8)
    assert reply.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert reply.usage.prompt_tokens > first.usage.prompt_tokens  # the call and its result were read


@pytest.mark.parametrize(
    ("change", "words"),
    [
        (
            {"tools": [{"type": "function", "function": {"name": "bad", "parameters": {"type": "array"}}}]},
            "'bad'",
        ),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nowhere"}}}, "nowhere"),
        ({"tool_choice": "required"}, "needs tools"),
        ({"functions": [WEATHER["function"]]}, "deprecated"),
        (
            {"messages": [*ASK, {"role": "tool", "tool_call_id": "call_x", "content": "18"}]},
            "answers no earlier call",
        ),
        (
            {"messages": [*ASK, {"role": "system", "content": "late"}], "tools": TOOLS},
            "System message must be at the beginning",
        ),
        ({"tools": TOOLS, "response_format": {"type": "json_object"}}, "response_format"),
    ],
)
def test_bad_tool_requests_are_400s_that_say_why(server: Server, change: dict, words: str) -> None:
    body = {"model": "tiny", "messages": ASK, "max_tokens": 4, **change}
    status, answer = server.raw("POST", "/v1/chat/completions", json.dumps(body).encode())
    assert status == 400 and words in answer["error"]["message"], answer
    assert server.raw("GET", "/health")[0] == 200
