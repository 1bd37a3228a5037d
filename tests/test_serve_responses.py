"""OpenAI's Responses API on `llmcli serve`, driven by the official client's `responses`:
the same reply as the chat route, streamed and not, function calls that validate, and a
conversation continued by `previous_response_id` with its cache reused."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from test_serve import Server, served
from tiny_models import build_tiny_model
from tool_templates import ADDED, HERMES_TEMPLATE, SPECIAL, WEATHER

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")

TOOL = {"type": "function", **WEATHER["function"]}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    folder = tmp_path_factory.mktemp("models") / "tiny-hermes-responses"
    build_tiny_model(folder, "llama", chat_template=HERMES_TEMPLATE, added=ADDED, special=SPECIAL)
    yield from served(folder, tmp_path_factory.mktemp("runtime"))


def test_a_response_is_the_chat_reply_streamed_and_not(server: Server) -> None:
    client = server.client()
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}]
    chat = client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0)
    asked = dict(model="tiny", instructions="Be brief.", input="Hello", max_output_tokens=8, temperature=0)
    response = client.responses.create(**asked)
    assert response.output_text == chat.choices[0].message.content
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert response.usage.output_tokens == 8 and response.usage.input_tokens == chat.usage.prompt_tokens
    with client.responses.stream(**asked) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_response()
    assert final.output_text == response.output_text
    assert kinds[:2] == ["response.created", "response.in_progress"] and "response.output_text.delta" in kinds


def test_a_response_names_the_model_served_and_one_not_here_is_a_404(server: Server) -> None:
    client = server.client()
    served = client.models.list().data[0].id
    asked = dict(model="tiny", input="Hello there", max_output_tokens=2)  # the config's alias of it
    assert client.responses.create(**asked).model == served
    with client.responses.stream(**asked) as stream:
        assert stream.get_final_response().model == served
    with pytest.raises(openai.NotFoundError, match="'gpt-elsewhere'"):
        client.responses.create(**(asked | {"model": "gpt-elsewhere"}))


def test_function_calls_validate_and_a_conversation_continues(server: Server) -> None:
    client = server.client()
    asked = dict(
        model="tiny", input="What is the weather in Paris?", tools=[TOOL], tool_choice="required",
        parallel_tool_calls=False, max_output_tokens=200, temperature=0,
    )  # fmt: skip
    response = client.responses.create(**asked)
    calls = [item for item in response.output if item.type == "function_call"]
    assert [call.name for call in calls] == ["get_weather"]
    jsonschema.validate(json.loads(calls[0].arguments), TOOL["parameters"])
    with client.responses.stream(**asked) as stream:
        final = stream.get_final_response()
    streamed = [(i.name, i.arguments) for i in final.output if i.type == "function_call"]
    assert streamed == [(calls[0].name, calls[0].arguments)]
    follow = client.responses.create(
        model="tiny", previous_response_id=response.id, tools=[TOOL], max_output_tokens=5,
        input=[{"type": "function_call_output", "call_id": calls[0].call_id, "output": "18 degrees"}],
    )  # fmt: skip
    assert follow.usage.input_tokens > response.usage.input_tokens
    assert follow.usage.input_tokens_details.cached_tokens > 0  # the earlier turn stayed in the cache


PNG = "data:image/png;base64,AAAA"  # read, then refused: a text model


@pytest.mark.parametrize(
    ("body", "status", "words"),
    [
        ({"input": "hi", "previous_response_id": "resp_nowhere"}, 404, "no stored response"),
        ({"input": "hi", "tools": [{"type": "web_search"}]}, 400, "web_search tools are not supported"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": PNG}]}]},
            400,
            "input_image",
        ),
        ({"input": "hi", "include": ["reasoning.encrypted_content"]}, 400, "include is not supported"),
    ],
)
def test_what_responses_cannot_do_is_refused(server: Server, body: dict, status: int, words: str) -> None:
    got, answer = server.raw("POST", "/v1/responses", json.dumps({"model": "tiny", **body}).encode())
    assert got == status and words in answer["error"]["message"], answer
