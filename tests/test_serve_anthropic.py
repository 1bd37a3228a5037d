"""Anthropic's Messages API on `llmcli serve`, driven by the official `anthropic` client: the same
replies as the OpenAI route, Anthropic's event stream, tool_use blocks that validate, tool results
read back, token counts, and Anthropic's error shape."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from test_serve import Server, served
from tiny_models import build_tiny_model
from tool_templates import ADDED, HERMES_TEMPLATE, SPECIAL, WEATHER

anthropic = pytest.importorskip("anthropic")
jsonschema = pytest.importorskip("jsonschema")

ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
TOOL = {
    "name": "get_weather",
    "description": WEATHER["function"]["description"],
    "input_schema": WEATHER["function"]["parameters"],
}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    folder = tmp_path_factory.mktemp("models") / "tiny-hermes-anthropic"
    build_tiny_model(folder, "llama", chat_template=HERMES_TEMPLATE, added=ADDED, special=SPECIAL)
    yield from served(folder, tmp_path_factory.mktemp("runtime"), "--api-key", "sekrit")


def client(server: Server):
    return anthropic.Anthropic(base_url=server.url, api_key="sekrit", max_retries=0)  # sent as x-api-key


def test_a_message_answers_as_the_openai_route_does_streamed_and_not(server: Server) -> None:
    openai_reply = server.client(api_key="sekrit").chat.completions.create(
        model="tiny", messages=ASK, max_tokens=8, temperature=0
    )
    expected = openai_reply.choices[0].message.content
    greedy = {"extra_body": {"temperature": 0}}  # older clients send it as a parameter
    message = client(server).messages.create(model="tiny", messages=ASK, max_tokens=8, **greedy)
    assert message.type == "message" and message.role == "assistant"
    assert [block.text for block in message.content] == [expected] and message.stop_reason == "max_tokens"
    assert message.usage.output_tokens == 8 and message.usage.input_tokens == openai_reply.usage.prompt_tokens
    with client(server).messages.stream(model="tiny", messages=ASK, max_tokens=8, **greedy) as stream:
        streamed = stream.get_final_message()
    assert [block.text for block in streamed.content] == [expected] and streamed.stop_reason == "max_tokens"
    counted = client(server).messages.count_tokens(model="tiny", messages=ASK)
    assert counted.input_tokens == openai_reply.usage.prompt_tokens


def test_a_message_names_the_model_served_and_one_not_here_is_a_404(server: Server) -> None:
    served = server.client(api_key="sekrit").models.list().data[0].id
    asked = dict(model="tiny", messages=ASK, max_tokens=2)  # the config's alias of the model served
    assert client(server).messages.create(**asked).model == served
    with client(server).messages.stream(**asked) as stream:
        assert stream.get_final_message().model == served
    with pytest.raises(anthropic.NotFoundError, match="'claude-elsewhere'"):
        client(server).messages.create(**(asked | {"model": "claude-elsewhere"}))


def test_a_stop_sequence_is_named_and_a_stream_starts_with_the_prompts_tokens(server: Server) -> None:
    greedy = {"extra_body": {"temperature": 0}}
    whole = client(server).messages.create(model="tiny", messages=ASK, max_tokens=12, **greedy)
    text = whole.content[0].text
    stop = text[5:7]
    asked = dict(model="tiny", messages=ASK, max_tokens=12, stop_sequences=["never there", stop], **greedy)
    stopped = client(server).messages.create(**asked)
    with client(server).messages.stream(**asked) as stream:
        streamed = stream.get_final_message()
    for message in (stopped, streamed):
        assert message.stop_reason == "stop_sequence" and message.stop_sequence == stop
        assert message.content[0].text == text[: text.find(stop)]
    events = client(server).messages.create(model="tiny", messages=ASK, max_tokens=3, stream=True, **greedy)
    start = next(iter(events))
    assert start.type == "message_start" and start.message.usage.input_tokens == whole.usage.input_tokens
    events.close()


def test_a_final_assistant_message_is_continued_not_answered_afresh(server: Server) -> None:
    reply = server.client(api_key="sekrit").chat.completions.create(
        model="tiny", messages=ASK, max_tokens=12, temperature=0, logprobs=True
    )
    first, *_ = [entry.token for entry in reply.choices[0].logprobs.content]
    assert first.isprintable() and "\ufffd" not in first, first  # a whole token's text, to send back
    prefilled = [*ASK, {"role": "assistant", "content": first}]
    greedy = {"extra_body": {"temperature": 0}}
    continued = client(server).messages.create(model="tiny", messages=prefilled, max_tokens=8, **greedy)
    text = continued.content[0].text
    assert text and reply.choices[0].message.content.removeprefix(first).startswith(text)  # its next tokens
    with client(server).messages.stream(model="tiny", messages=prefilled, max_tokens=8, **greedy) as stream:
        assert stream.get_final_message().content[0].text == text
    counted = client(server).messages.count_tokens(model="tiny", messages=prefilled)
    assert counted.input_tokens == continued.usage.input_tokens


def test_tool_use_blocks_validate_and_a_tool_result_is_read(server: Server) -> None:
    asked = dict(
        model="tiny", messages=ASK, max_tokens=200, extra_body={"temperature": 0}, tools=[TOOL],
        tool_choice={"type": "any", "disable_parallel_tool_use": True},
    )  # fmt: skip
    message = client(server).messages.create(**asked)
    uses = [block for block in message.content if block.type == "tool_use"]
    assert message.stop_reason == "tool_use" and [use.name for use in uses] == ["get_weather"]
    jsonschema.validate(uses[0].input, TOOL["input_schema"])
    with client(server).messages.stream(**asked) as stream:
        streamed = stream.get_final_message()
    assert [(b.name, b.input) for b in streamed.content if b.type == "tool_use"] == [
        (uses[0].name, uses[0].input)
    ]
    history = [
        *ASK,
        {"role": "assistant", "content": [use.model_dump() for use in uses]},
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": uses[0].id, "content": "18 degrees"}],
        },
    ]
    after = client(server).messages.create(model="tiny", messages=history, max_tokens=5, tools=[TOOL])
    assert after.usage.input_tokens > message.usage.input_tokens  # the call and its result were read


PNG = {"type": "base64", "media_type": "image/png", "data": "AAAA"}  # read, then refused: a text model


@pytest.mark.parametrize(
    ("body", "words"),
    [
        ({"messages": ASK}, "max_tokens"),
        (
            {"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "image", "source": PNG}]}]},
            "image blocks are not supported",
        ),
        ({"max_tokens": 5, "messages": ASK, "temperature": "hot"}, "temperature"),
        ({"max_tokens": 5, "messages": ASK, "container": "x"}, "container is not supported"),
        # values that were taken and then ignored
        (
            {"max_tokens": 5, "messages": ASK, "thinking": {"type": "enabled", "budget_tokens": 0}},
            "budget_tokens",
        ),
        ({"max_tokens": 5, "messages": ASK, "thinking": "on"}, "thinking"),
        ({"max_tokens": 5, "messages": ASK, "tool_choice": "any"}, "tool_choice"),
    ],
)
def test_bad_messages_are_400s_in_anthropics_shape(server: Server, body: dict, words: str) -> None:
    headers = {"Content-Type": "application/json", "x-api-key": "sekrit"}
    status, answer = server.raw(
        "POST", "/v1/messages", json.dumps({"model": "tiny", **body}).encode(), headers
    )
    assert status == 400 and answer["type"] == "error" and words in answer["error"]["message"], answer
    status, answer = server.raw("POST", "/v1/messages", json.dumps({"model": "tiny", **body}).encode())
    assert status == 401  # no key
