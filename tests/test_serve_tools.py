"""Tool calls through `llmcli serve`, read by the official `openai` client: calls that parse and
validate (streamed and not), a tool result's turn, and every bad input a 400 that says why."""

from __future__ import annotations

import json
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from cli_helpers import PATIENCE_S, run_cli
from test_serve import Server, assert_access_log_only, start_server
from tiny_models import build_tiny_model
from tool_templates import ADDED, HERMES_TEMPLATE, SPECIAL, TOOLS, WEATHER

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")

ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
SCHEMAS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}


@pytest.fixture(scope="module")
def server(hermes_server: Server) -> Server:
    return hermes_server


@pytest.fixture(scope="module")
def eager_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """A model that writes nothing but <tool_call> when it may: a residual dimension every
    embedding holds large, read by <tool_call>'s row of the output layer alone."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoTokenizer

    folder = tmp_path_factory.mktemp("models") / "tiny-eager-caller"
    build_tiny_model(folder, "llama", chat_template=HERMES_TEMPLATE, added=ADDED, special=SPECIAL)
    opener = AutoTokenizer.from_pretrained(folder).convert_tokens_to_ids("<tool_call>")
    weights = load_file(folder / "model.safetensors")
    weights["model.embed_tokens.weight"][:, 0] = 50.0
    weights["lm_head.weight"][:, 0] = 0.0
    weights["lm_head.weight"][opener, 0] = 4.0
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    running = start_server(folder, tmp_path_factory.mktemp("runtime"))
    yield running
    running.process.send_signal(signal.SIGTERM)
    assert running.process.wait(timeout=PATIENCE_S) == 0
    assert_access_log_only(running.process.stderr.read())


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
        if reply.choices[0].finish_reason != "length":  # a call the limit cut is given back as text
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


def test_a_call_the_length_limit_cuts_is_text_once_on_every_protocol_streamed_or_not(server: Server) -> None:
    client = server.client()
    asked = dict(model="tiny", messages=ASK, tools=TOOLS, tool_choice="required", temperature=0)
    made = client.chat.completions.create(**asked, max_tokens=200, parallel_tool_calls=False)
    limit = made.usage.completion_tokens - 8  # inside the call's arguments
    whole = client.chat.completions.create(**asked, max_tokens=limit, parallel_tool_calls=False)
    cut = whole.choices[0]
    assert cut.finish_reason == "length" and not cut.message.tool_calls
    assert cut.message.content.startswith("<tool_call>")  # given back as the text it was
    chunks = list(
        client.chat.completions.create(**asked, max_tokens=limit, parallel_tool_calls=False, stream=True)
    )
    deltas = [chunk.choices[0] for chunk in chunks if chunk.choices]
    assert not any(choice.delta.tool_calls for choice in deltas)  # no call, and then the text again
    assert "".join(choice.delta.content or "" for choice in deltas) == cut.message.content
    assert deltas[-1].finish_reason == "length"
    # Ollama's stream (its client, with tools and num_predict) ends with its done line.
    ollama = pytest.importorskip("ollama").Client(host=server.url)
    options = {"temperature": 0, "num_predict": 200}
    called = ollama.chat(model="tiny", messages=ASK, tools=TOOLS, options=options)
    assert called.message.tool_calls, "the greedy reply calls a tool"
    options["num_predict"] = called.eval_count - 8
    alone = ollama.chat(model="tiny", messages=ASK, tools=TOOLS, options=options)
    assert not alone.message.tool_calls and alone.done_reason == "length"
    lines = list(ollama.chat(model="tiny", messages=ASK, tools=TOOLS, options=options, stream=True))
    assert lines[-1].done and lines[-1].done_reason == "length" and not lines[-1].message.tool_calls
    assert "".join(line.message.content for line in lines) == alone.message.content
    # Anthropic's: text blocks only, the same text streamed or not.
    anthropic = pytest.importorskip("anthropic").Anthropic(base_url=server.url, api_key="-", max_retries=0)
    tools = [{"name": name, "input_schema": schema} for name, schema in SCHEMAS.items()]
    message_asked = dict(
        model="tiny", messages=ASK, tools=tools, tool_choice={"type": "any"}, max_tokens=limit,
        extra_body={"temperature": 0},
    )  # fmt: skip
    message = anthropic.messages.create(**message_asked)
    with anthropic.messages.stream(**message_asked) as stream:
        streamed = stream.get_final_message()
    for reply in (message, streamed):
        assert [block.type for block in reply.content] == ["text"] and reply.stop_reason == "max_tokens"
    assert streamed.content[0].text == message.content[0].text
    # The Responses API's: a message item only, the same text streamed or not.
    flat = [{"type": "function", **tool["function"]} for tool in TOOLS]
    response_asked = dict(
        model="tiny", input=ASK[0]["content"], tools=flat, tool_choice="required", temperature=0,
        max_output_tokens=limit, parallel_tool_calls=False,
    )  # fmt: skip
    response = client.responses.create(**response_asked)
    with client.responses.stream(**response_asked) as stream:
        final = stream.get_final_response()
    for reply in (response, final):
        assert [item.type for item in reply.output] == ["message"] and reply.status == "incomplete"
        assert reply.output_text == cut.message.content


def test_none_lets_no_call_out_in_any_form_on_every_protocol(eager_server: Server) -> None:
    client = eager_server.client()
    free = client.chat.completions.create(model="tiny", messages=ASK, max_tokens=4, temperature=0)
    assert free.choices[0].message.content == "<tool_call>" * 4  # what this model writes unheld
    asked = dict(model="tiny", messages=ASK, tools=TOOLS, tool_choice="none", max_tokens=30)
    texts = []
    for seed in range(2):
        whole = client.chat.completions.create(**asked, seed=seed)
        assert not whole.choices[0].message.tool_calls and whole.choices[0].finish_reason == "length"
        chunks = list(client.chat.completions.create(**asked, seed=seed, stream=True))
        assert not any(chunk.choices and chunk.choices[0].delta.tool_calls for chunk in chunks)
        texts += [
            whole.choices[0].message.content,
            "".join(c.choices[0].delta.content or "" for c in chunks if c.choices),
        ]
    function = TOOLS[0]["function"]
    tool = {"type": "function", "name": function["name"], "parameters": function["parameters"]}
    response = client.responses.create(
        model="tiny", input=ASK[0]["content"], tools=[tool], tool_choice="none", max_output_tokens=30
    )
    assert all(item.type == "message" for item in response.output)
    texts.append(response.output_text)
    anthropic = pytest.importorskip("anthropic").Anthropic(
        base_url=eager_server.url, api_key="-", max_retries=0
    )
    message = anthropic.messages.create(
        model="tiny", messages=ASK, max_tokens=30, tool_choice={"type": "none"},
        tools=[{"name": function["name"], "input_schema": function["parameters"]}],
    )  # fmt: skip
    assert [block.type for block in message.content] == ["text"] and message.stop_reason == "max_tokens"
    texts.append(message.content[0].text)
    assert all(text and "<tool_call>" not in text for text in texts), texts


def test_no_limit_is_512_tokens_and_ollamas_minus_one_is_the_contexts_room(eager_server: Server) -> None:
    ollama = pytest.importorskip("ollama").Client(host=eager_server.url)
    context = eager_server.raw("GET", "/health")[1]["context_length"]
    plain = eager_server.client().chat.completions.create(model="tiny", messages=ASK)  # no max_tokens
    assert plain.usage.completion_tokens == 512 and plain.choices[0].finish_reason == "length"
    for predict in (-1, -2):
        whole = ollama.chat(model="tiny", messages=ASK, options={"num_predict": predict})
        assert whole.done_reason == "length" and whole.prompt_eval_count + whole.eval_count == context
    last = list(ollama.chat(model="tiny", messages=ASK, options={"num_predict": -1}, stream=True))[-1]
    assert last.done and last.prompt_eval_count + last.eval_count == context


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


def test_generate_tools_prints_each_call_as_a_json_line_in_process_and_through_the_server(
    server: Server, tmp_path: Path
) -> None:
    tools_file = tmp_path / "tools.json"
    tools_file.write_text(json.dumps(TOOLS))
    env = {"XDG_RUNTIME_DIR": str(server.runtime)}
    args = ["generate", "-m", str(server.model), "--device", "cpu", "--dtype", "fp32", "-t", "0", "-n", "200"]
    asked = [*args, "--tools", str(tools_file), "--tool-choice", "get_weather", "Weather in Paris?"]
    local = run_cli(*asked, "--no-server", env=env)
    assert local.returncode == 0 and local.stderr == b"", local.stderr.decode()
    lines = [json.loads(line) for line in local.stdout.decode().splitlines()]
    assert [line["name"] for line in lines] == ["get_weather"]
    jsonschema.validate(lines[0]["arguments"], SCHEMAS["get_weather"])
    # The same through the running server, and the tools read from stdin; --json holds them too.
    remote = run_cli(*args, "--tools", "-", "--tool-choice", "get_weather", "--json", "Weather in Paris?",
                     stdin=json.dumps(TOOLS).encode(), env=env)  # fmt: skip
    assert remote.returncode == 0 and remote.stderr == b"", remote.stderr.decode()
    record = json.loads(remote.stdout)
    assert record["server"] == server.url and record["finish_reason"] == "tool_calls"
    assert [(c["name"], c["arguments"]) for c in record["tool_calls"]] == [
        (line["name"], line["arguments"]) for line in lines
    ]


NODE = {"type": "string", "maxLength": 6}
RECURSIVE = [  # trees: one through the tool's own $defs, one through its root ("#")
    {
        "type": "function",
        "function": {
            "name": "plant",
            "parameters": {
                "type": "object",
                "properties": {"root": {"$ref": "#/$defs/node"}},
                "required": ["root"],
                "additionalProperties": False,
                "$defs": {
                    "node": {
                        "type": "object",
                        "properties": {
                            "label": NODE,
                            "kids": {"type": "array", "items": {"$ref": "#/$defs/node"}},
                        },
                        "required": ["label"],
                        "additionalProperties": False,
                    }
                },
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "graft",
            "parameters": {
                "type": "object",
                "properties": {"label": NODE, "kid": {"$ref": "#"}},
                "required": ["label"],
                "additionalProperties": False,
            },
        },
    },
]


@pytest.mark.parametrize("name", ["plant", "graft"])
def test_recursive_tool_schemas_are_held_to_their_own_definitions(
    server: Server, tmp_path: Path, name: str
) -> None:
    """A tool's references are to its own schema: inside the calls' grammar they still are
    (they pointed at the grammar's root: nowhere, or at a whole call)."""
    tools_file = tmp_path / "tools.json"
    tools_file.write_text(json.dumps(RECURSIVE))
    schema = next(t["function"]["parameters"] for t in RECURSIVE if t["function"]["name"] == name)
    env = {"XDG_RUNTIME_DIR": str(server.runtime)}
    local = run_cli(
        "generate", "-m", str(server.model), "--no-server", "--device", "cpu", "--dtype", "fp32", "-t", "0",
        "-n", "200", "--tools", str(tools_file), "--tool-choice", name, "--json", "Grow a tree.", env=env,
    )  # fmt: skip
    assert local.returncode == 0, local.stderr.decode()
    record = json.loads(local.stdout)
    assert record["finish_reason"] == "tool_calls", record
    for call in record["tool_calls"]:
        jsonschema.validate(call["arguments"], schema)
    whole = server.client().chat.completions.create(
        model="tiny", messages=ASK, tools=RECURSIVE, temperature=0, max_tokens=200,
        tool_choice={"type": "function", "function": {"name": name}},
    )  # fmt: skip
    assert whole.choices[0].finish_reason == "tool_calls"
    for call in whole.choices[0].message.tool_calls:
        jsonschema.validate(json.loads(call.function.arguments), schema)


@pytest.mark.parametrize(
    ("flags", "words"),
    [
        (["--tools", "CYCLE"], "nests in itself with no way out"),
        (["--tools", "missing.json"], "no such file"),
        (["--tool-choice", "required"], "--tool-choice needs --tools"),
        (["--tools", "TOOLS", "--tool-choice", "nowhere"], "--tool-choice names 'nowhere'"),
        (["--tools", "TOOLS", "--format", "json"], "do not combine"),
        (["--tools", "TOOLS", "--raw"], "do not combine"),
        (["--tools", "NOT_JSON"], "not valid JSON"),
    ],
)
def test_generate_tools_bad_input_is_one_line_before_loading(
    tmp_path: Path, flags: list[str], words: str
) -> None:
    (tmp_path / "tools.json").write_text(json.dumps(TOOLS))
    (tmp_path / "bad.json").write_text("[{")
    node = {"type": "object", "properties": {"next": {"$ref": "#/$defs/node"}}, "required": ["next"]}
    parameters = {"type": "object", "properties": {"n": {"$ref": "#/$defs/node"}}, "$defs": {"node": node}}
    cycle = [{"type": "function", "function": {"name": "f", "parameters": {**parameters, "required": ["n"]}}}]
    (tmp_path / "cycle.json").write_text(json.dumps(cycle))
    files = {"TOOLS": str(tmp_path / "tools.json"), "NOT_JSON": str(tmp_path / "bad.json")}
    files["CYCLE"] = str(tmp_path / "cycle.json")
    result = run_cli("generate", "-m", "nowhere/never", *[files.get(f, f) for f in flags], "hi")
    lines = result.stderr.decode().splitlines()
    assert result.returncode == 2 and len(lines) == 1 and words in lines[0], lines


STRING_KEYS = {"type": "string"}  # what zod writes for a record's keys (Claude Code's, Codex's tools)
TAGS = {  # a record of tags: any name, each a string
    "type": "object",
    "properties": {
        "tags": {"type": "object", "propertyNames": STRING_KEYS, "additionalProperties": {"type": "string"}}
    },
    "required": ["tags"],
}
TAGGER = {"type": "function", "function": {"name": "tag", "description": "Tag the text.", "parameters": TAGS}}


def test_a_property_names_rule_that_says_keys_are_strings_is_taken_and_any_other_refused(
    server: Server,
) -> None:
    """Every JSON key is a string, so that propertyNames constrains nothing; the grammar engine
    implements no other, which is refused in one line, on tools and response_format alike."""
    client = server.client()
    asked = dict(model="tiny", messages=ASK, max_tokens=60, temperature=0)
    call = client.chat.completions.create(**asked, tools=[TAGGER], tool_choice="required")
    jsonschema.validate(json.loads(call.choices[0].message.tool_calls[0].function.arguments), TAGS)
    shaped = {"type": "json_schema", "json_schema": {"name": "tags", "schema": TAGS}}
    answer = client.chat.completions.create(**asked, response_format=shaped)
    if answer.choices[0].finish_reason == "stop":
        jsonschema.validate(json.loads(answer.choices[0].message.content), TAGS)
    lower = {"type": "string", "pattern": "^[a-z]+$"}
    narrowed = json.loads(json.dumps(TAGS).replace(json.dumps(STRING_KEYS), json.dumps(lower)))
    for refused in (
        dict(tools=[{"type": "function", "function": TAGGER["function"] | {"parameters": narrowed}}]),
        dict(response_format={"type": "json_schema", "json_schema": {"name": "tags", "schema": narrowed}}),
    ):
        with pytest.raises(openai.BadRequestError, match="propertyNames") as error:
            client.chat.completions.create(**asked, **refused)
        assert "\n" not in error.value.body["message"]
