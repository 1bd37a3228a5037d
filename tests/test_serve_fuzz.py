"""Every POST route of `llmcli serve` against hostile bodies: the wrong types, values nested
deeper than any parser recurses, fields no protocol has, and random JSON (property-based, with
hypothesis). Whatever comes, the answer is never a 500, an error comes in the shape of the
protocol the route speaks, and the server keeps serving. One real server, raw HTTP."""

from __future__ import annotations

import http.client
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from cli_helpers import PATIENCE_S
from test_serve import Server, assert_error_shape, served

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

HI = [{"role": "user", "content": "hi"}]
# A request each route answers with 200, the generation two tokens at most.
VALID: dict[str, dict[str, Any]] = {
    "/v1/chat/completions": {"model": "tiny", "messages": HI, "max_tokens": 2},
    "/v1/completions": {"model": "tiny", "prompt": "hi", "max_tokens": 2},
    "/v1/responses": {"model": "tiny", "input": [{"role": "user", "content": "hi"}], "max_output_tokens": 2},
    "/v1/messages": {"model": "tiny", "messages": HI, "max_tokens": 2},
    "/v1/messages/count_tokens": {"model": "tiny", "messages": HI},
    "/api/chat": {"model": "tiny", "messages": HI, "stream": False, "options": {"num_predict": 2}},
    "/api/generate": {"model": "tiny", "prompt": "hi", "stream": False, "options": {"num_predict": 2}},
    "/api/show": {"model": "tiny"},
}
TOOL = {"name": "get_weather", "description": "d", "parameters": {"type": "object", "properties": {}}}
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}}
# Bodies with most parts a route reads, answered too, for the fuzzing to change one place of.
RICH: dict[str, dict[str, Any]] = {
    "/v1/chat/completions": VALID["/v1/chat/completions"]
    | {
        "messages": [
            {"role": "system", "content": [{"type": "text", "text": "be brief"}]},
            {"role": "user", "content": "hi"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}
                ],
            },
            {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        ],
        "tools": [{"type": "function", "function": TOOL}],
        "tool_choice": "auto",
        "stop": ["x"],
        "logit_bias": {"5": 1},
        "stream": True,
        "stream_options": {"include_usage": True},
        "chat_template_kwargs": {"enable_thinking": False},
    },
    "/v1/completions": VALID["/v1/completions"] | {"prompt": [[1, 2, 3]], "logprobs": 1, "echo": True},
    "/v1/responses": VALID["/v1/responses"]
    | {
        "input": [
            {"role": "user", "content": [{"type": "input_text", "text": "hi"}]},
            {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
        ],
        "instructions": "be brief",
        "tools": [{"type": "function", **TOOL}],
        "stream": True,
    },
    "/v1/messages": VALID["/v1/messages"]
    | {
        "system": [{"type": "text", "text": "be brief"}],
        "messages": [
            {"role": "user", "content": "hi"},
            {
                "role": "assistant",
                "content": [{"type": "tool_use", "id": "t1", "name": "get_weather", "input": {}}],
            },
            {
                "role": "user",
                "content": [
                    {
                        "type": "tool_result",
                        "tool_use_id": "t1",
                        "content": [{"type": "text", "text": "sunny"}],
                    }
                ],
            },
        ],
        "tools": [{"name": "get_weather", "input_schema": TOOL["parameters"]}],
        "tool_choice": {"type": "auto"},
        "thinking": {"type": "disabled"},
        "stop_sequences": ["x"],
        "stream": True,
    },
    "/v1/messages/count_tokens": VALID["/v1/messages/count_tokens"]
    | {"system": "be brief", "tools": [{"name": "f", "input_schema": {}}]},
    "/api/chat": VALID["/api/chat"]
    | {
        "messages": [
            {"role": "user", "content": "hi"},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [{"function": {"name": "get_weather", "arguments": {}}}],
            },
            {"role": "tool", "tool_name": "get_weather", "content": "sunny"},
        ],
        "tools": [{"type": "function", "function": TOOL}],
        "options": {"num_predict": 2, "temperature": 0.5, "stop": ["x"], "num_ctx": 128},
        "keep_alive": "5m",
        "think": False,
        "stream": True,
    },
    "/api/generate": VALID["/api/generate"]
    | {"system": "be brief", "format": "json", "raw": False, "stream": True},
    "/api/show": VALID["/api/show"],
}
# A field of a route set to a value of another type, or nested too deep: each is a 400.
DEEP = {"a": 1}
for _ in range(900):
    DEEP = {"a": DEEP}
HOSTILE = [
    ("/v1/responses", {"input": "hi", "previous_response_id": [1]}),
    ("/v1/responses", {"input": "hi", "text": {"format": "json"}}),
    ("/v1/responses", {"input": "hi", "reasoning": "high"}),
    ("/v1/responses", {"input": 5}),
    ("/v1/responses", {"input": [{"role": "user", "content": [{"type": "input_text", "text": 5}]}]}),
    ("/v1/responses", {"input": "hi", "tools": 5}),
    ("/v1/responses", {"input": "hi", "tool_choice": ["auto"]}),
    ("/v1/messages", {"max_tokens": 2, "messages": 5}),
    (
        "/v1/messages",
        {"max_tokens": 2, "messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]},
    ),
    ("/v1/messages", {"max_tokens": 2, "messages": HI, "tools": 5}),
    ("/v1/messages", {"max_tokens": 2, "messages": HI, "system": 5}),
    ("/v1/messages/count_tokens", {"messages": [5]}),
    ("/api/chat", {"messages": 5}),
    ("/api/chat", {"messages": HI, "tools": 5}),
    ("/api/chat", {"messages": [{"role": "user", "content": 5}]}),
    ("/api/chat", {"messages": HI, "options": {"temperature": "hot"}}),
    ("/api/generate", {"prompt": 5}),
    ("/api/show", {"model": ["tiny"]}),
    ("/api/generate", {"prompt": "hi", "images": "AAAA"}),
    ("/v1/chat/completions", {"messages": HI, "chat_template_kwargs": DEEP}),
    ("/v1/chat/completions", {"messages": HI, "logit_bias": {"²": 1}}),
    ("/v1/chat/completions", {"messages": HI, "logit_bias": {"٣": 1}}),
]


@pytest.fixture(scope="module")
def server(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    yield from served(tiny_llama, tmp_path_factory.mktemp("runtime"), "--ctx", "512", "--quiet")


def post(server: Server, path: str, body: bytes) -> tuple[int, bytes]:
    connection = http.client.HTTPConnection(server.host, int(server.port), timeout=PATIENCE_S)
    try:
        connection.request("POST", path, body=body, headers={"Content-Type": "application/json"})
        response = connection.getresponse()
        return response.status, response.read()
    finally:
        connection.close()


def assert_answered_in_shape(path: str, status: int, answer: bytes) -> None:
    """Never a 500; an error in the route's own shape; a 200's stream without a failure in it."""
    assert status < 500, (status, answer[:500])
    if status >= 400:
        assert_error_shape(path, json.loads(answer))
    else:  # a stream that failed once begun says so in its events: a 500 in disguise
        for failure in (b'"server_error"', b'"api_error"', b'{"error":'):
            assert failure not in answer.replace(b": ", b":"), answer[:500]


def test_the_valid_bodies_are_answered(server: Server) -> None:
    for path, body in [*VALID.items(), *RICH.items()]:
        status, answer = post(server, path, json.dumps(body).encode())
        assert status == 200, (path, answer)


@pytest.mark.parametrize(("path", "fields"), HOSTILE, ids=[f"{p}-{sorted(f)[-1]}" for p, f in HOSTILE])
def test_a_value_of_the_wrong_type_is_a_400_in_the_routes_shape(
    server: Server, path: str, fields: dict
) -> None:
    status, answer = post(server, path, json.dumps({"model": "tiny", **fields}).encode())
    assert status == 400, answer
    assert_error_shape(path, json.loads(answer))


@pytest.mark.parametrize("path", sorted(VALID))
def test_a_body_nested_deeper_than_a_parser_recurses_is_a_400(server: Server, path: str) -> None:
    status, answer = post(server, path, b"[" * 100_000 + b"]" * 100_000)
    assert status == 400 and "nested" in str(json.loads(answer)), answer
    assert_error_shape(path, json.loads(answer))
    inside = VALID[path] | {"model": "[" * 1000}  # brackets in a string are text: a name not here
    status, answer = post(server, path, json.dumps(inside).encode())
    assert status == 404 and "no model" in str(json.loads(answer)), answer


JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats()  # NaN and infinities too: Python's JSON writes and reads them
    | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=10,
)


def paths_of(value: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every place in a JSON value, itself first."""
    found = [prefix]
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, inner in items:
        found += paths_of(inner, (*prefix, key))
    return found


def replaced(value: Any, path: tuple[Any, ...], new: Any) -> Any:
    if not path:
        return new
    copy = dict(value) if isinstance(value, dict) else list(value)
    copy[path[0]] = replaced(value[path[0]], path[1:], new)
    return copy


@st.composite
def bodies(draw: st.DrawFn, path: str) -> Any:
    """A route's valid body with one place in it replaced by any JSON value, or a field added,
    or any JSON value at all."""
    valid = draw(st.sampled_from([VALID[path], RICH[path]]))
    kind = draw(st.sampled_from(["replace", "add", "any"]))
    if kind == "any":
        return draw(JSON)
    if kind == "add":
        name = draw(
            st.sampled_from(["stream", "tools", "tool_choice", "format", "options", "raw"])
            | st.text(max_size=8)
        )
        return valid | {name: draw(JSON)}
    where = draw(st.sampled_from(paths_of(valid)[1:]))
    return replaced(valid, where, draw(JSON))


@pytest.mark.parametrize("path", sorted(VALID))
def test_no_body_is_a_500_and_every_error_is_in_the_routes_shape(server: Server, path: str) -> None:
    @settings(max_examples=20, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
    @given(body=bodies(path))
    def answered(body: Any) -> None:
        status, answer = post(server, path, json.dumps(body).encode())
        assert_answered_in_shape(path, status, answer)

    answered()
    assert post(server, path, json.dumps(VALID[path]).encode())[0] == 200  # and it keeps serving
