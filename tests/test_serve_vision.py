"""Images through a real `llmcli serve` of a vision-language model, sent by the official SDKs in
each protocol's own shape: the reply equals the in-process one for the same image and text, the
image's tokens are counted, the same image in a later request is served from the cache, and a
bad image is a 400 in the protocol's shape that leaves the server serving."""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from test_vision_engine import png

from cli_helpers import run_cli
from test_serve import Server, served
from tiny_models import build_tiny_model

openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")
ollama = pytest.importorskip("ollama")

PICTURE = png(30, 26, 11)
DATA_URL = "data:image/png;base64," + base64.b64encode(PICTURE).decode()
TOKENS = 4


@pytest.fixture(scope="module", params=["gemma3_vl", "qwen3_5_vl"])
def folder(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("serve-vision") / request.param, request.param)


@pytest.fixture(scope="module")
def server(folder: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    yield from served(folder, tmp_path_factory.mktemp("runtime"))


@pytest.fixture(scope="module")
def in_process(folder: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """`generate --image` in-process: the reply the server must give."""
    picture = tmp_path_factory.mktemp("pictures") / "photo.png"
    picture.write_bytes(PICTURE)
    args = ("-t", "0", "-n", str(TOKENS), "--json", "--image", str(picture), "What is it?")
    proc = run_cli("generate", "-m", str(folder), *args)
    assert proc.returncode == 0, proc.stderr.decode()
    return json.loads(proc.stdout)


def openai_ask(server: Server) -> openai.types.chat.ChatCompletion:
    content = [{"type": "image_url", "image_url": {"url": DATA_URL}}, {"type": "text", "text": "What is it?"}]
    return server.client().chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": content}], temperature=0, max_tokens=TOKENS
    )


def test_openai_image_replies_as_in_process_and_is_cached_the_second_time(
    server: Server, in_process: dict
) -> None:
    first = openai_ask(server)
    assert first.choices[0].message.content == in_process["text"]
    assert first.usage.prompt_tokens == in_process["prompt_tokens"]
    second = openai_ask(server)
    assert second.choices[0].message.content == in_process["text"]
    assert second.usage.prompt_tokens_details.cached_tokens >= in_process["image_tokens"]


def test_every_protocol_reads_its_own_image_shape(server: Server, in_process: dict) -> None:
    b64 = base64.b64encode(PICTURE).decode()
    answer = server.client().responses.create(
        model="tiny",
        input=[
            {
                "role": "user",
                "content": [
                    {"type": "input_image", "image_url": DATA_URL},
                    {"type": "input_text", "text": "What is it?"},
                ],
            }
        ],
        temperature=0,
        max_output_tokens=TOKENS,
    )
    assert answer.output_text == in_process["text"]
    client = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": b64}}
    message = [{"role": "user", "content": [image, {"type": "text", "text": "What is it?"}]}]
    reply = client.messages.create(
        model="tiny", messages=message, max_tokens=TOKENS, extra_body={"temperature": 0}
    )
    assert reply.content[0].text == in_process["text"]
    counted = client.messages.count_tokens(model="tiny", messages=message)
    assert counted.input_tokens == in_process["prompt_tokens"]
    chat = ollama.Client(host=server.url).chat(
        model="tiny",
        messages=[{"role": "user", "content": "What is it?", "images": [b64]}],
        options={"temperature": 0, "num_predict": TOKENS},
    )
    assert chat.message.content == in_process["text"]


def test_a_bad_image_is_a_400_and_the_server_serves_on(server: Server) -> None:
    client = server.client()
    broken = "data:image/png;base64," + base64.b64encode(PICTURE[:50]).decode()
    content = [{"type": "image_url", "image_url": {"url": broken}}, {"type": "text", "text": "hi"}]
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": content}], max_tokens=2
        )
    assert "messages[0].content[0]" in str(refused.value)
    remote = [
        {"type": "image_url", "image_url": {"url": "http://127.0.0.1:9/x.png"}},
        {"type": "text", "text": "hi"},
    ]
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": remote}], max_tokens=2
        )
    assert "--allow-image-urls" in str(refused.value)
    assert openai_ask(server).choices[0].message.content is not None
