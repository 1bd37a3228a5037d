"""Ollama's API on `llmcli serve`, driven by the official `ollama` client: the same replies as the
OpenAI routes, NDJSON streams, Ollama's error shape, and every option it cannot honour refused."""

from __future__ import annotations

import json

import pytest

from test_serve import Server

ollama = pytest.importorskip("ollama")

GREEDY = {"temperature": 0, "num_predict": 8}


@pytest.fixture(scope="module")
def server(tiny_llama_server: Server) -> Server:
    return tiny_llama_server


def client(server: Server):
    return ollama.Client(host=server.url)


def test_the_model_is_listed_shown_and_running(server: Server, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OLLAMA_HOST", f"{server.host}:{server.port}")  # as a user points a tool at it
    listed = ollama.Client().list().models  # the model held, then those it may load by name
    assert listed[0].size > 0 and all(model.size == 0 for model in listed[1:])
    name = listed[0].model
    shown = client(server).show(name)
    assert "im_start" in shown.template and "completion" in shown.capabilities
    assert [m.model for m in client(server).ps().models] == [name]
    status, version = server.raw("GET", "/api/version")
    assert status == 200 and version["version"]


def test_chat_and_generate_answer_as_the_openai_routes_do(server: Server) -> None:
    messages = [{"role": "user", "content": "Hello there"}]
    openai_reply = server.client().chat.completions.create(
        model="tiny", messages=messages, max_tokens=8, temperature=0
    )
    expected = openai_reply.choices[0].message.content
    whole = client(server).chat(model="tiny", messages=messages, options=GREEDY)
    assert whole.message.content == expected and whole.done and whole.done_reason == "length"
    assert whole.eval_count == 8 and whole.prompt_eval_count == openai_reply.usage.prompt_tokens
    streamed = list(client(server).chat(model="tiny", messages=messages, options=GREEDY, stream=True))
    assert "".join(part.message.content for part in streamed) == expected
    assert streamed[-1].done and not any(part.done for part in streamed[:-1])
    generated = client(server).generate(model="tiny", prompt="Hello there", options=GREEDY)
    assert generated.response == expected  # generate applies the chat template, as ollama's does
    pieces = list(client(server).generate(model="tiny", prompt="Hello there", options=GREEDY, stream=True))
    assert "".join(piece.response for piece in pieces) == expected and pieces[-1].done
    raw = client(server).generate(model="tiny", prompt="Hello there", raw=True, options=GREEDY)
    text = server.client().completions.create(model="tiny", prompt="Hello there", max_tokens=8, temperature=0)
    assert raw.response == text.choices[0].text


def test_replies_name_the_model_served_and_a_model_not_here_is_a_404(server: Server) -> None:
    served = server.client().models.list().data[0].id
    messages = [{"role": "user", "content": "Hello there"}]
    asked = dict(model="tiny", options=GREEDY)  # the config's alias of the model served
    replies = [
        client(server).chat(messages=messages, **asked),
        *client(server).chat(messages=messages, stream=True, **asked),
        client(server).generate(prompt="Hello there", **asked),
        *client(server).generate(prompt="Hello there", stream=True, **asked),
    ]
    assert {reply.model for reply in replies} == {served}
    with pytest.raises(ollama.ResponseError) as refused:
        client(server).chat(model="another-model", messages=messages, options=GREEDY)
    assert refused.value.status_code == 404 and "'another-model'" in refused.value.error


def test_format_json_holds_the_reply_to_json(server: Server) -> None:
    reply = client(server).chat(
        model="tiny", messages=[{"role": "user", "content": "JSON please"}], format="json",
        options={"temperature": 0.8, "seed": 3, "num_predict": 200},
    )  # fmt: skip
    assert isinstance(json.loads(reply.message.content), dict)


@pytest.mark.parametrize(
    ("asked", "words"),
    [
        ({"options": {"num_ctx": 10**6}}, "over the loaded context"),
        ({"options": {"mirostat": 2}}, "option mirostat is not supported"),
        (
            {"messages": [{"role": "user", "content": "what is this?", "images": ["AAAA"]}]},
            "images are not supported",
        ),
        ({"format": "yaml"}, "format is"),
        ({"options": {"temperature": -1}}, "temperature"),
        ({"keep_alive": "abc"}, "keep_alive 'abc' is not a duration"),
        ({"options": {"num_ctx": -5}}, "num_ctx"),
        ({"template": "{{ .Prompt }}"}, "template is not supported"),
    ],
)
def test_what_cannot_be_honoured_is_refused_in_ollamas_error_shape(
    server: Server, asked: dict, words: str
) -> None:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "stream": False} | asked
    if asked.get("format") != "yaml" and "template" not in asked:  # the client cannot send these
        with pytest.raises(ollama.ResponseError) as refused:
            client(server).chat(**body)
        assert refused.value.status_code == 400 and words in refused.value.error
    status, answer = server.raw("POST", "/api/chat", json.dumps(body).encode())
    assert status == 400 and set(answer) == {"error"} and words in answer["error"]
    for refused_generate in ({"suffix": "y"}, {"raw": True, "system": "Be brief."}):
        generate = {"model": "tiny", "prompt": "x", "stream": False, **refused_generate}
        status, _ = server.raw("POST", "/api/generate", json.dumps(generate).encode())
        assert status == 400


@pytest.mark.parametrize(
    ("path", "asked", "words"),
    [
        ("/api/chat", {"keep_alive": []}, "keep_alive"),
        ("/api/chat", {"keep_alive": {}}, "keep_alive"),
        ("/api/generate", {"raw": "false"}, "raw"),  # a text, not a boolean: it turned raw mode on
        ("/api/generate", {"raw": 0}, "raw"),
    ],
)
def test_a_value_no_ollama_client_sends_is_refused_not_guessed(
    server: Server, path: str, asked: dict, words: str
) -> None:
    body = {"model": "tiny", "prompt": "x", "stream": False, **asked}
    if path == "/api/chat":
        body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "stream": False, **asked}
    status, answer = server.raw("POST", path, json.dumps(body).encode())
    assert status == 400 and set(answer) == {"error"} and words in answer["error"], answer


def test_a_tool_call_and_its_result_round_trip(server: Server) -> None:
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
    asked = [{"role": "user", "content": "Weather in Paris?"}]
    first = client(server).chat(model="tiny", messages=asked, tools=[tool], options=GREEDY)
    history = [
        *asked,
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}],
        },
        {"role": "tool", "tool_name": "get_weather", "content": "18 degrees"},
    ]
    after = client(server).chat(model="tiny", messages=history, tools=[tool], options=GREEDY)
    assert after.done and after.prompt_eval_count > first.prompt_eval_count  # the call and result were read
