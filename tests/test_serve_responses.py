"""OpenAI's Responses API on `llmcli serve`, driven by the official client's `responses`:
the same reply as the chat route, streamed and not, function calls that validate, and a
conversation continued by `previous_response_id` with its cache reused."""

from __future__ import annotations

import json

import pytest

from test_serve import Server
from tool_templates import WEATHER

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")

TOOL = {"type": "function", **WEATHER["function"]}


@pytest.fixture(scope="module")
def server(hermes_server: Server) -> Server:
    return hermes_server


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
        ({"input": "hi", "tools": [{"type": "web_search"}]}, 400, "web_search is a hosted tool"),
        ({"input": "hi", "tools": [{"type": "local_shell"}]}, 400, "local_shell tools are not supported"),
        (
            {"input": "hi", "tools": [{"type": "namespace", "name": "n", "tools": [{"type": "web_search"}]}]},
            400,
            "tools[0].tools[0]: web_search tools in a namespace are not supported",
        ),
        ({"input": "hi", "tools": [TOOL, TOOL]}, 400, "a second tool named 'get_weather'"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": PNG}]}]},
            400,
            "input_image",
        ),
        (
            {"input": "hi", "include": ["message.output_text.logprobs"]},
            400,
            "include: message.output_text.logprobs is not supported here (reasoning.encrypted_content is)",
        ),
    ],
)
def test_what_responses_cannot_do_is_refused(server: Server, body: dict, status: int, words: str) -> None:
    got, answer = server.raw("POST", "/v1/responses", json.dumps({"model": "tiny", **body}).encode())
    assert got == status and words in answer["error"]["message"], answer


NAMESPACE = {
    "type": "namespace",
    "name": "weather_v1",
    "description": "Tools for the weather.",
    "tools": [TOOL],
}


def test_a_namespace_tool_is_called_by_its_name_and_comes_back_under_its_namespace(server: Server) -> None:
    """As Codex CLI sends its sub-agent tools, and reads their calls back (`namespace` on the
    function_call, as OpenAI's API answers)."""
    client = server.client()
    asked = dict(
        model="tiny", input="What is the weather in Paris?", tools=[NAMESPACE], max_output_tokens=200,
        tool_choice={"type": "function", "name": "get_weather"}, temperature=0,
    )  # fmt: skip
    response = client.responses.create(**asked)
    [call] = [item for item in response.output if item.type == "function_call"]
    assert (call.name, call.namespace) == ("get_weather", "weather_v1")
    with client.responses.stream(**asked) as stream:
        [streamed] = [item for item in stream.get_final_response().output if item.type == "function_call"]
    assert (streamed.name, streamed.namespace, streamed.arguments) == (
        call.name,
        call.namespace,
        call.arguments,
    )
    follow = client.responses.create(
        model="tiny", tools=[NAMESPACE], max_output_tokens=3,
        input=[
            {"role": "user", "content": "What is the weather in Paris?"},
            {"type": "function_call", "call_id": call.call_id, "name": call.name, "namespace": call.namespace,
             "arguments": call.arguments},
            {"type": "function_call_output", "call_id": call.call_id,
             "output": [{"type": "input_text", "text": "18 degrees"}]},
        ],
    )  # fmt: skip
    assert follow.status in ("completed", "incomplete") and follow.usage.input_tokens > 0


def test_a_stored_response_is_read_back_and_deleted(server: Server) -> None:
    client = server.client()
    response = client.responses.create(model="tiny", input="Hello", max_output_tokens=4, temperature=0)
    read = client.responses.retrieve(response.id)
    assert (read.id, read.output_text, read.usage) == (response.id, response.output_text, response.usage)
    client.responses.delete(response.id)
    for gone in (
        lambda: client.responses.retrieve(response.id),
        lambda: client.responses.delete(response.id),
    ):
        with pytest.raises(openai.NotFoundError, match="no stored response"):
            gone()
    with pytest.raises(openai.NotFoundError):  # and it can no longer be continued
        client.responses.create(model="tiny", input="More", previous_response_id=response.id)


def test_input_tokens_counts_the_prompt_a_response_would_read(server: Server) -> None:
    client = server.client()
    asked = dict(model="tiny", instructions="Be brief.", input="What is the weather in Paris?", tools=[TOOL])
    counted = client.responses.input_tokens.count(**asked)
    assert counted.object == "response.input_tokens"
    answered = client.responses.create(**asked, max_output_tokens=1)
    assert counted.input_tokens == answered.usage.input_tokens
    earlier = client.responses.input_tokens.count(
        model="tiny", input="More", previous_response_id=answered.id
    )
    assert earlier.input_tokens > client.responses.input_tokens.count(model="tiny", input="More").input_tokens
    with pytest.raises(openai.BadRequestError, match="web_search is a hosted tool"):
        client.responses.input_tokens.count(model="tiny", input="hi", tools=[{"type": "web_search"}])


def test_compact_is_refused_by_name_in_the_responses_error_shape(server: Server) -> None:
    """Codex CLI compacts a custom provider's conversation with a summary turn on /v1/responses
    (tests/test_codex_requests.py); the compaction endpoint is refused in one line, not
    FastAPI's bare 404 or the 405 of the GET /v1/responses/{id} route beside it."""
    client = server.client()
    with pytest.raises(openai.NotFoundError, match="/v1/responses/compact is not supported here") as refused:
        client.responses.compact(model="tiny", input="Hello")
    assert refused.value.body["param"] is None and "\n" not in refused.value.message
