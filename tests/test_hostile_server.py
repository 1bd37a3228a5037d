"""A hostile server named with --server: llmcli reads what it sends within bounds and shows its
text inert. A stream that never ends stops at -n, a stream that sends nothing useful is given up,
an error body is read to 64 KiB at most, and a server's message is one short line on stderr in
which no escape sequence acts. Each server here is real (a socket on 127.0.0.1), and so is the
CLI that meets it, as a subprocess."""

from __future__ import annotations

import http.server
import itertools
import json
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import ClassVar

import pexpect
import pytest

from llmcli.server.client import Client, StreamBrokenError

from cli_helpers import LLMCLI, PATIENCE_S, local_http_server, one_error_line, run_cli

ESCAPES = "\x1b]0;pwned\x07\x1b[2K\rllmcli: error: forged\n\x9b31m"
INERT = "\\x1b]0;pwned\\x07\\x1b[2K\\rllmcli: error: forged\\n\\x9b31m"


def chunk(content: str | None = None, finish: str | None = None, **delta: object) -> bytes:
    if content is not None:
        delta["content"] = content
    event = {"choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
    return f"data: {json.dumps(event)}\n\n".encode()


@dataclass
class Behaviour:
    """What the server does for one path prefix, and what it saw: bytes it sent before the
    client closed (or all of them), and whether the client left before it was done."""

    post: Callable[[http.server.BaseHTTPRequestHandler], Iterator[bytes]]
    status: int = 200
    headers: dict[str, str] = field(default_factory=lambda: {"Content-Type": "text/event-stream"})
    sent: int = 0
    client_left: bool = False
    done: threading.Event = field(default_factory=threading.Event)


class HostileHandler(http.server.BaseHTTPRequestHandler):
    behaviours: ClassVar[dict[str, Behaviour]] = {}

    def _behaviour(self) -> Behaviour | None:
        return self.behaviours.get(self.path.split("/")[1])

    def do_GET(self) -> None:
        behaviour = self._behaviour()
        if behaviour is None or not self.path.endswith("/v1/models"):
            self.send_error(404)
            return
        body = json.dumps({"data": [{"id": f"evil{ESCAPES}" + "m" * 1000}]}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self) -> None:
        behaviour = self._behaviour()
        assert behaviour is not None
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.send_response(behaviour.status)
        for name, value in behaviour.headers.items():
            self.send_header(name, value)
        self.end_headers()
        try:
            for piece in behaviour.post(self):
                self.wfile.write(piece)
                self.wfile.flush()
                behaviour.sent += len(piece)
        except OSError:  # the client closed the connection: what it read is bounded by then
            behaviour.client_left = True
        finally:
            self.close_connection = True
            behaviour.done.set()

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def hostile() -> Iterator[Callable[..., str]]:
    """hostile(post, **fields) → the URL of a server that answers every POST with `post`."""
    names = itertools.count()
    with local_http_server(HostileHandler) as url:

        def serve(post: Callable[..., Iterator[bytes]], **fields: object) -> str:
            name = f"b{next(names)}"
            HostileHandler.behaviours[name] = Behaviour(post, **fields)  # type: ignore[arg-type]
            return f"{url}/{name}"

        yield serve
    HostileHandler.behaviours.clear()


def behaviour_of(url: str) -> Behaviour:
    return HostileHandler.behaviours[url.rsplit("/", 1)[1]]


def forever(_: object) -> Iterator[bytes]:
    while True:
        yield chunk("tok ")


def test_a_stream_that_never_ends_stops_at_max_new_tokens(hostile: Callable[..., str]) -> None:
    url = hostile(forever)
    result = run_cli("generate", "--server", url, "-m", "any", "-n", "16", "--json", "hi")
    assert result.returncode == 0, result.stderr
    record = json.loads(result.stdout)
    assert record["finish_reason"] == "length"
    # Each piece is at least a token: 16 and a small margin are read, then the connection closes.
    assert 16 <= record["text"].count("tok") <= 40
    assert behaviour_of(url).done.wait(PATIENCE_S) and behaviour_of(url).client_left
    # Plain text too: the output is bounded, and the run ends.
    text = run_cli("generate", "--server", hostile(forever), "-m", "any", "-n", "16", "hi")
    assert text.returncode == 0 and 16 <= text.stdout.decode().count("tok") <= 40


def huge_error(_: object) -> Iterator[bytes]:
    """256 MiB of one JSON error message, made as it is sent."""
    yield b'{"error": {"message": "'
    for _ in range(256 * 1024):
        yield b"x" * 1024
    yield b'"}}'


def test_a_huge_error_body_is_read_only_in_part(hostile: Callable[..., str]) -> None:
    url = hostile(huge_error, status=500, headers={"Content-Type": "application/json"})
    result = run_cli("generate", "--server", url, "-m", "any", "hi")
    line = one_error_line(result, 1)
    assert f"{url} answered 500: " in line and line.endswith("…") and len(line) < 500
    behaviour = behaviour_of(url)
    assert behaviour.done.wait(PATIENCE_S)
    # 64 KiB read; the rest never: what was sent is what the sockets' buffers held, not 256 MiB.
    assert behaviour.client_left and behaviour.sent < 32 * 1024 * 1024


def escaping_text(_: object) -> Iterator[bytes]:
    """A 5 MB message, as plain text."""
    yield (ESCAPES + "y" * 5_000_000).encode()


def escaping_json(_: object) -> Iterator[bytes]:
    yield json.dumps({"error": {"message": ESCAPES + "y" * 1000}}).encode()


def escaping_event(_: object) -> Iterator[bytes]:
    yield chunk("Hi")
    yield f"data: {json.dumps({'error': {'message': ESCAPES + 'z' * 1000}})}\n\n".encode()


@pytest.mark.parametrize(
    ("post", "status"), [(escaping_text, 400), (escaping_json, 503), (escaping_event, 200)]
)
def test_a_servers_message_is_one_short_line_with_its_escapes_inert(
    hostile: Callable[..., str], post: Callable[..., Iterator[bytes]], status: int
) -> None:
    url = hostile(post, status=status)
    line = one_error_line(run_cli("generate", "--server", url, "-m", "any", "hi"), 1)
    assert INERT in line and "\x1b" not in line and "\r" not in line and "\x9b" not in line
    assert line.endswith("…") and len(line) < 500


def escaping_reply(_: object) -> Iterator[bytes]:
    yield chunk(reasoning_content=f"think{ESCAPES}")
    yield chunk(f"Hi{ESCAPES}", finish=f"stop{ESCAPES}")
    yield b"data: [DONE]\n\n"


def test_a_servers_model_name_and_finish_are_shown_inert(hostile: Callable[..., str]) -> None:
    """No -m: the name is the server's first model, shown in the --stats line."""
    result = run_cli("generate", "--server", hostile(escaping_reply), "--stats", "hi")
    err = result.stderr.decode()
    assert result.returncode == 0, err
    assert len(err.splitlines()) == 1 and f"evil{INERT}" in err and "\x1b" not in err
    assert f"stop{INERT}" in err
    assert result.stdout.decode() == f"Hi{ESCAPES}\n"  # a pipe gets the model's text as it is


def test_a_reply_on_a_terminal_has_its_escape_sequences_inert(hostile: Callable[..., str]) -> None:
    url = hostile(escaping_reply)
    env = {**os.environ, "TERM": "xterm-256color", "NO_COLOR": "1"}
    child = pexpect.spawn(
        sys.executable, [*LLMCLI[1:], "generate", "--server", url, "-m", "any", "--think", "show", "hi"],
        env=env, timeout=PATIENCE_S,
    )  # fmt: skip
    child.expect(pexpect.EOF)
    child.close()
    seen = child.before
    assert child.exitstatus == 0, seen
    # Lines and tabs are the text's own; every other control character is written out.
    line, after = INERT.split("\\n")
    assert f"think{line}".encode() in seen and f"Hi{line}".encode() in seen and after.encode() in seen
    assert b"\x1b]0;" not in seen and b"\x9b" not in seen and b"\x1b[2K\r" not in seen


def malformed(_: object) -> Iterator[bytes]:
    yield chunk("Hi")
    yield b'data: {"choices": 5}\n\n'


def endless_line(_: object) -> Iterator[bytes]:
    yield b'data: {"choices": [{"delta": {"content": "'
    while True:
        yield b"x" * 65536


@pytest.mark.parametrize(
    ("post", "said"), [(malformed, "not in OpenAI's shape"), (endless_line, "over 1 MiB")]
)
def test_a_chunk_out_of_shape_breaks_the_reply_in_one_line(
    hostile: Callable[..., str], post: Callable[..., Iterator[bytes]], said: str
) -> None:
    url = hostile(post)
    result = run_cli("generate", "--server", url, "-m", "any", "--json", "hi")
    assert said in one_error_line(result, 1)
    assert json.loads(result.stdout)["finish_reason"] == "error"


def keep_alives(first: bytes) -> Callable[..., Iterator[bytes]]:
    def post(_: object) -> Iterator[bytes]:
        yield first
        while True:  # until the client closes the connection
            yield b": keep-alive\n\n" + chunk("")  # a comment, and a chunk with nothing in it
            time.sleep(0.01)  # the server's pace (a real one sends these every few seconds)

    return post


def silence(handler: http.server.BaseHTTPRequestHandler) -> Iterator[bytes]:
    yield chunk(role="assistant", content="")  # the role alone, as servers start
    yield chunk("Hi")
    handler.rfile.read()  # until the client closes: never a byte more


@pytest.mark.parametrize(
    ("post", "text", "waited"),
    [(keep_alives(b""), "", "2"), (keep_alives(chunk("Hi")), "Hi", "0.5"), (silence, "Hi", "0.5")],
)
def test_a_stream_that_sends_nothing_useful_is_given_up(
    hostile: Callable[..., str], post: Callable[..., Iterator[bytes]], text: str, waited: str
) -> None:
    """The first useful event may take the whole timeout (queue, prefill); later ones stall_s."""
    client = Client(hostile(post), timeout_s=2.0, stall_s=0.5)
    pieces = []
    with pytest.raises(StreamBrokenError, match=f"sent nothing of the reply for {waited} s"):
        for event in client.stream("chat/completions", {"model": "any"}):
            pieces += [choice["delta"].get("content") or "" for choice in event["choices"]]
    assert "".join(pieces) == text
