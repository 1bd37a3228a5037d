"""Claude Code's own requests, replayed on `llmcli serve`: the first request of a session and its
follow-up after a tool_result, as Claude Code 2.1.197 sent them (tests/data/claude_code: captured,
their long texts shortened, every field, header and block and tool shape kept), sent through the
official `anthropic` client's beta Messages API (as Claude Code sends them: `?beta=true`, its
`anthropic-beta` header), streamed and whole, and byte for byte over HTTP. What a local server
cannot do is refused in one line; the context errors come in the words Claude Code reads."""

from __future__ import annotations

import http.client
import json
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from test_serve import Server, served
from tiny_models import build_tiny_model
from tool_templates import ADDED, HERMES_TEMPLATE, SPECIAL

anthropic = pytest.importorskip("anthropic")
jsonschema = pytest.importorskip("jsonschema")

DATA = Path(__file__).parent / "data" / "claude_code"
CONTEXT = 32768  # Claude Code's prompt (its tools above all) is ~16k tokens for a tiny tokenizer
# Claude Code's own patterns (cli.js): it retries with the max_tokens that fits, or compacts.
OVERFLOW = re.compile(r"input length and `max_tokens` exceed context limit: (\d+) \+ (\d+) > (\d+)")
TOO_LONG = re.compile(r"prompt is too long[^0-9]*(\d+)\s*tokens?\s*>\s*(\d+)", re.IGNORECASE)
ANSWERED = ("max_tokens", "tool_use", "end_turn")


def captured(name: str) -> dict:
    return json.loads((DATA / f"{name}.json").read_text())


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    # Hermes' template refuses a system message anywhere but first: Claude Code sends one second.
    folder = tmp_path_factory.mktemp("models") / "tiny-claude-code"
    build_tiny_model(folder, "llama", chat_template=HERMES_TEMPLATE, added=ADDED, special=SPECIAL)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config | {"max_position_embeddings": CONTEXT}))
    # The captured requests name the model "demo" (ANTHROPIC_MODEL) and "demo-small" (its small,
    # fast one): the config's aliases for it, as a user of Claude Code would write them.
    aliases = {"demo": folder, "demo-small": folder, "m": folder}
    yield from served(folder, tmp_path_factory.mktemp("runtime"), "--api-key", "sekrit", aliases=aliases)


def client(server: Server):
    return anthropic.Anthropic(base_url=server.url, api_key="sekrit", max_retries=0)  # sent as x-api-key


def sdk_arguments(request: dict, max_tokens: int = 8) -> dict:
    """The captured request as the SDK's beta client sends it: its body, its betas, its headers."""
    headers = {key: value for key, value in request["headers"].items() if key.lower().startswith("x-")}
    betas = request["headers"]["anthropic-beta"].split(",")
    body = {key: value for key, value in request["body"].items() if key != "stream"}
    return body | {"max_tokens": max_tokens, "betas": betas, "extra_headers": headers}


def raw(server: Server, request: dict, body: dict) -> tuple[int, str]:
    """The request sent over HTTP as Claude Code sent it: its path, its headers, this body."""
    connection = http.client.HTTPConnection(server.host, int(server.port), timeout=120)
    try:
        headers = request["headers"] | {"x-api-key": "sekrit"}
        connection.request(request["method"], request["path"], json.dumps(body).encode(), headers)
        response = connection.getresponse()
        return response.status, response.read().decode()
    finally:
        connection.close()


def events_of(stream: str) -> list[dict]:
    return [json.loads(line[len("data: ") :]) for line in stream.splitlines() if line.startswith("data: ")]


def test_the_first_request_and_the_follow_up_after_a_tool_result_are_answered(server: Server) -> None:
    first, follow_up = captured("first_request"), captured("follow_up")
    assert [block["type"] for block in follow_up["body"]["messages"][-1]["content"]] == ["tool_result"]
    answers = []
    for request in (first, follow_up):
        with client(server).beta.messages.stream(**sdk_arguments(request)) as stream:
            streamed = stream.get_final_message()
        whole = client(server).beta.messages.create(**sdk_arguments(request))
        for message in (streamed, whole):
            assert message.stop_reason in ANSWERED and message.content and message.usage.output_tokens > 0
        answers.append(streamed)
    # the tool_use and its result were read, after a prompt the KV cache held: the same prefix
    assert answers[1].usage.input_tokens > answers[0].usage.input_tokens
    assert answers[1].usage.cache_read_input_tokens >= answers[0].usage.input_tokens - 8


def test_the_captured_bytes_stream_anthropics_events(server: Server) -> None:
    request = captured("follow_up")
    status, text = raw(server, request, request["body"] | {"max_tokens": 8})
    assert status == 200, text
    kinds = [event["type"] for event in events_of(text)]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    assert "content_block_delta" in kinds


def test_claude_codes_max_tokens_over_the_context_is_refused_in_the_words_it_retries_on(
    server: Server,
) -> None:
    request = captured("first_request")
    assert request["body"]["max_tokens"] == 32000  # as sent: more than this context leaves
    status, text = raw(server, request, request["body"])
    error = json.loads(text)
    assert status == 400 and error["type"] == "error", text
    prompt, asked, context = map(int, OVERFLOW.fullmatch(error["error"]["message"].split(",")[0]).groups())
    assert (asked, context) == (32000, CONTEXT)
    arguments = sdk_arguments(request)
    del arguments["max_tokens"], arguments["metadata"]  # a count takes neither
    counted = client(server).beta.messages.count_tokens(**arguments)
    assert prompt == counted.input_tokens
    # what Claude Code then sends: context - prompt - 1000
    status, text = raw(server, request, request["body"] | {"max_tokens": 8, "stream": False})
    assert status == 200 and json.loads(text)["stop_reason"] in ANSWERED


def test_a_prompt_over_the_context_is_refused_in_the_words_claude_code_compacts_on(server: Server) -> None:
    body = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "word " * CONTEXT}]}
    status, text = raw(server, captured("first_request"), body)
    message = json.loads(text)["error"]["message"]
    assert status == 400 and "\n" not in message
    prompt, limit = map(int, TOO_LONG.match(message).groups())
    assert prompt > limit == CONTEXT - 1


def test_the_title_request_s_output_format_constrains_the_reply(server: Server) -> None:
    request = captured("title_request")
    assert request["body"]["output_config"]["format"]["type"] == "json_schema"
    assert client(server).beta.messages.create(**sdk_arguments(request)).stop_reason in ANSWERED
    schema = request["body"]["output_config"]["format"]["schema"]
    bounded = json.loads(json.dumps(schema))
    bounded["properties"]["title"]["maxLength"] = 12  # a random model's title then ends
    arguments = sdk_arguments(request, max_tokens=64)
    arguments["output_config"] = {"format": {"type": "json_schema", "schema": bounded}}
    message = client(server).beta.messages.create(**arguments)
    jsonschema.validate(json.loads(message.content[0].text), schema)


def test_a_mid_conversation_system_message_joins_the_user_turn_before_it(server: Server) -> None:
    counted = {}
    for shape, messages in {
        "system message": [
            {"role": "user", "content": "hello"},
            {"role": "system", "content": [{"type": "text", "text": "agents: none"}]},
        ],
        "joined": [{"role": "user", "content": "hello\n\nagents: none"}],
    }.items():
        counted[shape] = client(server).beta.messages.count_tokens(model="m", messages=messages).input_tokens
    assert counted["system message"] == counted["joined"]


def test_the_billing_header_block_is_no_part_of_the_prompt(server: Server) -> None:
    """Its cc_version changes between Claude Code's requests: kept, no prompt would share a start."""
    request = captured("title_request")
    system = request["body"]["system"]
    assert system[0]["text"].startswith("x-anthropic-billing-header:")
    other = [{"type": "text", "text": "x-anthropic-billing-header: cc_version=9.9.9.abc;"}, *system[1:]]
    common = {"model": "m", "messages": request["body"]["messages"]}
    counts = [
        client(server).beta.messages.count_tokens(**common, system=blocks).input_tokens
        for blocks in (system, other, system[1:])
    ]
    assert counts[0] == counts[1] == counts[2]


def test_head_of_the_root_answers_as_claude_code_warms_its_connection(server: Server) -> None:
    """It sends no key with it: a server with --api-key answers 401, which Claude Code ignores."""
    for headers, status in (({"x-api-key": "sekrit"}, 200), ({}, 401)):
        connection = http.client.HTTPConnection(server.host, int(server.port), timeout=30)
        try:
            connection.request("HEAD", "/", headers=headers)
            assert connection.getresponse().status == status
        finally:
            connection.close()


WEB_SEARCH = {"type": "web_search_20250305", "name": "web_search", "max_uses": 5}
# A record whose keys are held to a pattern: a propertyNames the grammar engine does not implement
# (one that says only that keys are strings is taken: Claude Code's own tools carry it).
KEYS_NARROWED = {
    "type": "object",
    "propertyNames": {"pattern": "^[a-z]+$"},
    "additionalProperties": {"type": "string"},
}


@pytest.mark.parametrize(
    ("change", "words"),
    [
        ({"tools": [WEB_SEARCH]}, "tools.0: web_search_20250305 is a server tool"),
        ({"tools": [{"type": "bash_20250124", "name": "bash"}]}, "'bash_20250124' is not supported"),
        (
            {"context_management": {"edits": [{"type": "clear_tool_uses_20250919"}]}},
            "clear_tool_uses_20250919 is not supported here",
        ),
        ({"output_config": {"effort": "extreme"}}, "output_config.effort"),
        ({"output_config": {"format": {"type": "json_object"}}}, "output_config.format.type"),
        ({"thinking": {"type": "adaptive", "budget_tokens": 1024}}, "thinking adaptive has no budget"),
        ({"messages": [{"role": "system", "content": [{"type": "image"}]}]}, "only text blocks"),
        ({"tools": [{"name": "tag", "input_schema": KEYS_NARROWED}]}, "propertyNames"),
        (
            {"tools": [], "output_config": {"format": {"type": "json_schema", "schema": KEYS_NARROWED}}},
            "propertyNames",
        ),
    ],
)
def test_what_a_local_server_cannot_do_is_refused_in_one_line(
    server: Server, change: dict, words: str
) -> None:
    request = captured("first_request")
    status, text = raw(server, request, request["body"] | {"max_tokens": 8} | change)
    error = json.loads(text)
    assert status == 400 and error["type"] == "error", text
    assert words in error["error"]["message"] and "\n" not in error["error"]["message"], text


def test_hosted_tools_are_left_out_with_one_warning_where_the_server_drops_them(
    capfd: pytest.CaptureFixture[str],
) -> None:
    from llmcli.errors import LlmcliError
    from llmcli.server.anthropic_tools import screen_hosted_tools
    from llmcli.server.hosted_tools import HostedTools

    custom = {"name": "Write", "input_schema": {"type": "object"}}
    tools = [WEB_SEARCH, custom, {"type": "web_fetch_20250910", "name": "web_fetch"}]
    dropping = HostedTools(drop=True)
    assert screen_hosted_tools(tools, dropping) == screen_hosted_tools(tools, dropping) == [custom]
    warned = capfd.readouterr().err
    assert warned.count("web_search_20250305") == 1 and warned.count("web_fetch_20250910") == 1, warned
    with pytest.raises(LlmcliError, match="web_search_20250305"):
        screen_hosted_tools(tools, HostedTools())


@pytest.mark.parametrize(
    ("effort", "reads", "expected"), [("max", True, "high"), ("low", True, "low"), ("max", False, None)]
)
def test_effort_is_the_templates_reasoning_effort_where_it_reads_one(
    effort: str, reads: bool, expected: str | None
) -> None:
    from llmcli.server.anthropic import _chat_request

    body = {
        "max_tokens": 5,
        "messages": [{"role": "user", "content": "hi"}],
        "output_config": {"effort": effort},
    }
    asked, _ = _chat_request(body, reads_effort=reads)
    assert asked.reasoning_effort == expected


def test_an_error_result_says_so_to_the_model(server: Server) -> None:
    """Claude Code marks a refused or failed call `is_error`: a tool message has no such flag."""
    call = {"type": "tool_use", "id": "toolu_1", "name": "Write", "input": {"file_path": "a"}}
    tools = [{"name": "Write", "input_schema": {"type": "object"}, "strict": True}]
    counts = []
    for result in (
        {"type": "tool_result", "tool_use_id": "toolu_1", "content": "denied", "is_error": True},
        {"type": "tool_result", "tool_use_id": "toolu_1", "content": "Error: denied"},
        {"type": "tool_result", "tool_use_id": "toolu_1", "content": "denied"},
    ):
        messages = [
            {"role": "user", "content": "write a"},
            {"role": "assistant", "content": [call]},
            {"role": "user", "content": [result]},
        ]
        counts.append(client(server).beta.messages.count_tokens(model="m", messages=messages, tools=tools))
    assert counts[0].input_tokens == counts[1].input_tokens > counts[2].input_tokens


def test_claude_codes_quota_probe_is_answered(server: Server) -> None:
    """Its shape in cli.js (source "quota_check", for subscribers): one token, not streamed."""
    probe = {"model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": "quota"}]}
    request = captured("first_request")
    metadata = request["body"]["metadata"]
    status, text = raw(server, request, probe | {"metadata": metadata})
    assert status == 200 and json.loads(text)["stop_reason"] in ("max_tokens", "end_turn"), text
