"""Images through every server protocol, each in its own shape (OpenAI's image_url parts, the
Responses API's input_image, Anthropic's image blocks, Ollama's images), read into the one
protocol-neutral form the engine side takes: a message's content as text and image parts, each
image an ImageInput named as the request names it. Remote URLs are fetched only under
`--allow-image-urls`, from a real http.server here; a text-only model refuses each image by its
label, through a real `llmcli serve` and the official clients, and keeps serving."""

from __future__ import annotations

import base64
import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from llmcli.errors import LlmcliError
from llmcli.models.vision.encoder import ImageInput
from llmcli.server import anthropic as anthropic_adapter
from llmcli.server import ollama as ollama_adapter
from llmcli.server import responses as responses_adapter
from llmcli.server.images import fetch, resolve
from llmcli.server.protocol import ChatRequest

from test_serve import Server, served

openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")
ollama = pytest.importorskip("ollama")

PNG = b"\x89PNG\r\n\x1a\n" + bytes(range(64))  # bytes only: decoding them is the model side's
PNG_B64 = base64.b64encode(PNG).decode()
DATA_URL = f"data:image/png;base64,{PNG_B64}"
CAP = 1000  # the fetch cap the tests give, small enough to exceed in a test


def images_of(messages: list[dict[str, Any]]) -> list[tuple[str, bytes]]:
    """The images of neutral messages, resolved for a model that reads them: (label, bytes)."""
    resolved = resolve(messages, reads_images=True, allow_urls=False)
    found = []
    for message in resolved:
        content = message["content"]
        for part in content if isinstance(content, list) else ():
            if part["type"] == "image":
                assert isinstance(part["image"], ImageInput)
                found.append((part["image"].label, part["image"].data))
            else:
                assert part == {"type": "text", "text": part["text"]}
    return found


def openai_messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    return ChatRequest.model_validate(body).chat_messages()


def responses_messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    return responses_adapter._input(body)


def anthropic_messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    asked, _ = anthropic_adapter._chat_request({"max_tokens": 5, **body})
    return asked.chat_messages()


def ollama_messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    route = ollama_adapter._chat_request if "messages" in body else ollama_adapter._generate_request
    return route(None, body)["messages"]


def openai_image(url: str, **more: Any) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url, **more}}


def responses_image(url: str, **more: Any) -> dict[str, Any]:
    return {"type": "input_image", "image_url": url, "detail": "auto", **more}


def anthropic_image(data: str = PNG_B64, media_type: str = "image/png") -> dict[str, Any]:
    return {"type": "image", "source": {"type": "base64", "media_type": media_type, "data": data}}


def chat(*content: Any, role: str = "user") -> dict[str, Any]:
    """A one-message request body, as OpenAI's chat and Anthropic's Messages API write it."""
    return {"messages": [{"role": role, "content": list(content)}]}


def inputs(*content: Any) -> dict[str, Any]:
    """A one-item Responses request body."""
    return {"input": [{"role": "user", "content": list(content)}]}


ASK = {"type": "text", "text": "What is it?"}
INPUT_ASK = {"type": "input_text", "text": "What is it?"}

# One request per protocol, as its official client sends it: text, then an image.
SHAPES = {
    "openai": (openai_messages, chat(ASK, openai_image(DATA_URL)), "messages[0].content[1]"),
    "responses": (responses_messages, inputs(INPUT_ASK, responses_image(DATA_URL)), "input[0].content[1]"),
    "anthropic": (anthropic_messages, chat(ASK, anthropic_image()), "messages[0].content[1]"),
    "ollama chat": (
        ollama_messages,
        {"messages": [{"role": "user", "content": "What is it?", "images": [PNG_B64]}]},
        "messages[0].images[0]",
    ),
    "ollama generate": (ollama_messages, {"prompt": "What is it?", "images": [PNG_B64]}, "images[0]"),
}


@pytest.mark.parametrize("protocol", SHAPES)
def test_each_protocols_image_reaches_the_neutral_form_named_as_the_request_names_it(protocol: str) -> None:
    read, body, label = SHAPES[protocol]
    messages = read(body)
    assert images_of(messages) == [(label, PNG)]
    texts = [part["text"] for part in messages[-1]["content"] if part["type"] == "text"]
    assert texts == ["What is it?"]


def test_a_message_without_images_keeps_its_plain_text() -> None:
    for read in (openai_messages, anthropic_messages):
        assert read(chat({"type": "text", "text": "hi"})) == [{"role": "user", "content": "hi"}]


def test_several_images_keep_their_order_and_each_its_label() -> None:
    other = b"GIF89a" + bytes(10)
    other_url = "data:image/gif;base64," + base64.b64encode(other).decode()
    body = chat(openai_image(DATA_URL), {"type": "text", "text": "and"}, openai_image(other_url))
    body["messages"].insert(0, {"role": "system", "content": "Be brief."})
    assert images_of(openai_messages(body)) == [
        ("messages[1].content[0]", PNG),
        ("messages[1].content[2]", other),
    ]
    ollama_body = {"messages": [{"role": "user", "content": "", "images": [PNG_B64, PNG_B64]}]}
    assert [label for label, _ in images_of(ollama_messages(ollama_body))] == [
        "messages[0].images[0]",
        "messages[0].images[1]",
    ]


BAD = [
    # (protocol, the request, words its one-line refusal holds)
    ("openai", chat(openai_image("data:image/png;base64,AA=A")), "not valid base64"),
    ("openai", chat(openai_image("data:text/plain;base64,AAAA")), "of text/plain, not of an image"),
    ("openai", chat(openai_image("data:image/png,AAAA")), "not base64"),
    ("openai", chat(openai_image("photo.png")), "sent inline"),
    ("openai", chat(openai_image(DATA_URL, detail="low")), "detail 'low' is not honoured"),
    ("openai", chat(openai_image(DATA_URL), role="assistant"), "user messages only"),
    ("responses", inputs(responses_image("data:image/png;base64,!!!!")), "not valid base64"),
    ("responses", inputs(responses_image(DATA_URL, detail="high")), "detail 'high' is not honoured"),
    ("responses", inputs({"type": "input_image", "file_id": "file-1"}), "file_id is not supported"),
    ("anthropic", chat(anthropic_image("AAAA\n")), "not valid base64"),
    ("anthropic", chat(anthropic_image(media_type="application/pdf")), "'application/pdf' is not an image's"),
    ("anthropic", chat({"type": "image", "source": {"type": "file", "file_id": "f"}}), "no files API"),
    ("ollama chat", {"messages": [{"role": "user", "content": "hi", "images": ["no!"]}]}, "not valid base64"),
    ("ollama generate", {"prompt": "hi", "images": [PNG_B64], "raw": True}, "raw turns it off"),
]


@pytest.mark.parametrize(("protocol", "body", "words"), BAD)
def test_a_bad_image_is_refused_in_one_line_naming_it(
    protocol: str, body: dict[str, Any], words: str
) -> None:
    read, _, _ = SHAPES[protocol]
    with pytest.raises(LlmcliError) as refused:
        read(body)
    message = refused.value.one_line()
    assert words in message and "\n" not in message
    named = ("messages[0]", "input[0]", "images[0]")
    assert message.removeprefix("image ").startswith(named) or "raw" in words, message


def test_other_part_kinds_stay_refused() -> None:
    audio = {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}
    with pytest.raises(ValueError, match="input_audio parts are not supported"):
        openai_messages({"messages": [{"role": "user", "content": [audio]}]})
    with pytest.raises(LlmcliError, match="document blocks are not supported"):
        anthropic_messages({"messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]})
    with pytest.raises(LlmcliError, match="input_file parts are not supported"):
        responses_messages({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]})


class Images(ThreadingHTTPServer):
    """A tiny image host on 127.0.0.1: the paths it serves, and every path asked for."""

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), ImageHandler)
        self.asked: list[str] = []
        self.stopping = threading.Event()

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}{path}"


class ImageHandler(BaseHTTPRequestHandler):
    server: Images

    def do_GET(self) -> None:
        self.server.asked.append(self.path)
        if self.path == "/photo.png":
            self._send(PNG, declared=True)
        elif self.path == "/big-declared.png":
            self._send(bytes(CAP + 1), declared=True)
        elif self.path == "/big-undeclared.png":  # no Content-Length: only reading finds its size
            self._send(bytes(CAP + 1), declared=False)
        elif self.path == "/drip.png":  # a byte at a time, each in time, until the client leaves
            self.send_response(200)
            self.end_headers()
            while not self.server.stopping.wait(0.05):
                try:
                    self.wfile.write(b"x")
                    self.wfile.flush()
                except OSError:
                    return
        elif self.path == "/to-ftp":  # urllib follows ftp: by itself (file: it refuses)
            self.send_response(302)
            self.send_header("Location", "ftp://127.0.0.1/photo.png")
            self.end_headers()
        else:
            self.send_error(404)

    def _send(self, body: bytes, declared: bool) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "image/png")
        if declared:
            self.send_header("Content-Length", str(len(body)))
        else:
            self.close_connection = True
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture(scope="module")
def image_host() -> Iterator[Images]:
    host = Images()
    thread = threading.Thread(target=host.serve_forever, daemon=True)
    thread.start()
    yield host
    host.stopping.set()
    host.shutdown()
    host.server_close()


def url_messages(url: str) -> list[dict[str, Any]]:
    return openai_messages({"messages": [{"role": "user", "content": [openai_image(url)]}]})


def test_a_remote_url_is_refused_without_the_flag_and_never_fetched(image_host: Images) -> None:
    asked_before = len(image_host.asked)
    url = image_host.url("/photo.png")
    for messages in (
        url_messages(url),
        responses_messages(inputs(responses_image(url))),
        anthropic_messages(chat({"type": "image", "source": {"type": "url", "url": url}})),
    ):
        with pytest.raises(LlmcliError) as refused:
            resolve(messages, reads_images=True, allow_urls=False)
        assert "SSRF" in refused.value.message and "llmcli serve --allow-image-urls" in refused.value.message
    assert len(image_host.asked) == asked_before


def test_with_the_flag_a_remote_image_is_fetched_into_its_image_input(image_host: Images) -> None:
    resolved = resolve(url_messages(image_host.url("/photo.png")), reads_images=True, allow_urls=True)
    assert resolved[0]["content"][0]["image"] == ImageInput(PNG, "messages[0].content[0]")


def test_a_text_only_model_refuses_a_remote_image_without_fetching_it(image_host: Images) -> None:
    asked_before = len(image_host.asked)
    with pytest.raises(
        LlmcliError, match=r"messages\[0\]\.content\[0\]: this server's model reads text only"
    ):
        resolve(url_messages(image_host.url("/photo.png")), reads_images=False, allow_urls=True)
    assert len(image_host.asked) == asked_before


@pytest.mark.parametrize(
    ("path", "words"),
    [
        ("/big-declared.png", f"over {CAP} bytes"),
        ("/big-undeclared.png", f"over {CAP} bytes"),
        ("/to-ftp", "not http(s)"),
        ("/drip.png", "took over 0.5 s"),
        ("/missing.png", "answered 404"),
    ],
)
def test_a_fetch_that_fails_or_runs_past_the_cap_is_refused(
    image_host: Images, path: str, words: str
) -> None:
    with pytest.raises(LlmcliError) as refused:
        timeout_s = 0.5 if "drip" in path else 30  # a dripping host is held to half a second in all
        fetch(image_host.url(path), "messages[0].content[0]", cap=CAP, timeout_s=timeout_s)
    assert words in refused.value.message and refused.value.message.startswith("messages[0].content[0]: ")
    assert fetch(image_host.url("/photo.png"), "x", cap=len(PNG)) == PNG  # the cap itself is allowed


# Through a real server: the tiny text model refuses every image by its label, in its protocol's
# shape, and keeps serving.


@pytest.fixture(scope="module")
def server(tiny_llama_server: Server) -> Server:
    return tiny_llama_server


def still_serving(server: Server) -> None:
    reply = server.client().chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2
    )
    assert reply.choices[0].finish_reason in ("length", "stop")


def send_chat(client: Any, url: str) -> Any:
    return client.chat.completions.create(model="tiny", messages=chat(ASK, openai_image(url))["messages"])


def send_response(client: Any, url: str) -> Any:
    return client.responses.create(model="tiny", input=inputs(INPUT_ASK, responses_image(url))["input"])


OPENAI_ROUTES = {
    "chat": (send_chat, "messages[0].content[1]", "image_url parts"),
    "responses": (send_response, "input[0].content[1]", "input_image parts"),
}


@pytest.mark.parametrize("route", OPENAI_ROUTES)
def test_openai_routes_images_through_the_server(server: Server, route: str) -> None:
    send, label, kind = OPENAI_ROUTES[route]
    for url, words in (
        (DATA_URL, f"this server's model reads text only: {kind} are not supported"),
        ("https://example.com/cat.png", "this server does not fetch the image URLs"),
        ("data:image/png;base64,AA=A", "not valid base64"),
    ):
        with pytest.raises(openai.BadRequestError) as refused:
            send(server.client(), url)
        assert f"{label}: {words}" in refused.value.message
        if "fetch" in words:
            assert "llmcli serve --allow-image-urls" in refused.value.message
        still_serving(server)


@pytest.mark.parametrize(
    ("part", "words"),
    [
        ({"type": "image_url", "image_url": DATA_URL}, 'an image_url part is {"type": "image_url"'),
        ({"type": "image_url", "image_url": {"url": DATA_URL, "size": 3}}, "image_url.size is not supported"),
        ({"type": "image", "image": {"data": PNG_B64}}, "image parts are not supported here"),
    ],
)
def test_a_malformed_image_part_is_a_400_that_says_its_shape(server: Server, part: dict, words: str) -> None:
    status, answer = server.raw("POST", "/v1/chat/completions", json.dumps(chat(ASK, part)).encode())
    assert status == 400 and words in answer["error"]["message"], answer
    assert answer["error"]["message"].startswith("messages.0.content: ")


def test_anthropic_images_and_their_count_through_the_server(server: Server) -> None:
    client = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)
    url_image = {"type": "image", "source": {"type": "url", "url": "https://example.com/cat.png"}}
    for block, words in (
        (anthropic_image(), "messages[0].content[1]: this server's model reads text only: image blocks"),
        (url_image, "messages[0].content[1]: this server does not fetch the image URLs"),
        (anthropic_image("AAA"), "messages[0].content[1]: not valid base64"),
    ):
        messages = [{"role": "user", "content": [{"type": "text", "text": "What is it?"}, block]}]
        for call in (client.messages.create, client.messages.count_tokens):
            extra = {"max_tokens": 5} if call == client.messages.create else {}
            with pytest.raises(anthropic.BadRequestError) as refused:
                call(model="tiny", messages=messages, **extra)
            assert refused.value.status_code == 400 and words in refused.value.message
        still_serving(server)


def test_ollama_images_through_the_server(server: Server) -> None:
    client = ollama.Client(host=server.url)
    with pytest.raises(ollama.ResponseError) as refused:
        client.chat(model="tiny", messages=[{"role": "user", "content": "What is it?", "images": [PNG]}])
    assert refused.value.status_code == 400
    assert "messages[0].images[0]: this server's model reads text only: images" in refused.value.error
    still_serving(server)
    with pytest.raises(ollama.ResponseError) as refused:
        client.generate(model="tiny", prompt="What is it?", images=[PNG])
    assert refused.value.status_code == 400 and refused.value.error.startswith(
        "images[0]: this server's model"
    )
    still_serving(server)
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi", "images": ["@@@@"]}]}
    status, answer = server.raw("POST", "/api/chat", json.dumps(body).encode())
    assert status == 400 and answer["error"].startswith("image messages[0].images[0]: not valid base64")
    still_serving(server)


def test_with_the_flag_a_text_only_server_refuses_a_remote_image_without_fetching_it(
    tiny_llama: Path, tmp_path: Path, image_host: Images
) -> None:
    asked_before = len(image_host.asked)
    running = served(tiny_llama, tmp_path, "--allow-image-urls")
    flagged = next(running)
    content = [{"type": "text", "text": "What is it?"}, openai_image(image_host.url("/photo.png"))]
    with pytest.raises(openai.BadRequestError) as refused:
        flagged.client().chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": content}]
        )
    assert "messages[0].content[1]: this server's model reads text only" in refused.value.message
    assert len(image_host.asked) == asked_before
    still_serving(flagged)
    next(running, None)  # stopped gracefully
