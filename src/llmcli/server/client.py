"""A small OpenAI-API client on the standard library: what `generate` uses to reach a server.

Made for start-up time, not features: http.client and json import in milliseconds, where the
`openai` package (or httpx) would cost more than a warm server's whole answer. It speaks to
llmcli's own server and to any OpenAI-compatible one (vLLM, llama.cpp's server, ollama, SGLang).
"""

from __future__ import annotations

import contextlib
import http.client
import json
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit

from llmcli.errors import LlmcliError
from llmcli.reading import MiB, peer_text

# Sampling settings whose name in the OpenAI API differs from llmcli's; the others (top_k, min_p,
# repetition_penalty: extras vLLM and llama.cpp's server read too) travel under their own names.
OPENAI_NAMES = {"max_new_tokens": "max_tokens"}

# What is read from a server, at most. A peer is not trusted to end what it sends: an error body
# is shown in 300 characters, so more than 64 KiB of it is never read; a model list or /health
# far above any real one, or one server-sent event (a line) over 1 MiB, is refused.
ERROR_BYTES = 64 * 1024
BODY_BYTES = 4 * MiB
EVENT_BYTES = 1 * MiB
# How long a streaming reply may go without a useful event (text, thinking, a call, the finish,
# the usage) once its first has come. Keep-alive comments and empty chunks do not count: a server
# that sends only those is as stalled as a silent one. The first useful event may take the
# client's whole timeout_s (600 s): it waits for the server's queue and the prompt's prefill.
STALL_S = 120.0


class ServerError(LlmcliError):
    """The server answered with an error, or could not be reached."""


class StreamBrokenError(ServerError):
    """A reply stopped before the server said it was complete: what came is a part of it."""


class Client:
    def __init__(
        self, url: str, api_key: str | None = None, timeout_s: float = 600.0, stall_s: float = STALL_S
    ) -> None:
        parts = urlsplit(url if "://" in url else f"http://{url}")
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise LlmcliError(f"--server {url!r} is not an http(s) URL", "e.g. http://127.0.0.1:8471")
        self.url = url.rstrip("/")
        self._https = parts.scheme == "https"
        self._host = parts.hostname
        self._port = parts.port or (443 if self._https else 80)
        path = parts.path.rstrip("/")
        # The API lives under /v1; a URL given without it (as llmcli prints it, or bare) gets it.
        self._base = path if path.endswith("/v1") else f"{path}/v1"
        self._root = self._base.removesuffix("/v1")
        self.api_key = api_key
        self.timeout_s = timeout_s
        self.stall_s = stall_s

    def _connection(self, timeout_s: float) -> http.client.HTTPConnection:
        kind = http.client.HTTPSConnection if self._https else http.client.HTTPConnection
        return kind(self._host, self._port, timeout=timeout_s)

    def _headers(self) -> dict[str, str]:
        headers = {"Content-Type": "application/json", "Accept": "application/json, text/event-stream"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        return headers

    def llmcli_health(self, timeout_s: float = 1.0) -> dict[str, Any] | None:
        """llmcli's /health (the model and how it is loaded), or None from any other server."""
        try:
            status, body = self._get(f"{self._root}/health", timeout_s)
        except (OSError, http.client.HTTPException, ServerError):
            return None
        if status != 200:
            return None
        try:
            data = json.loads(body)
        except (ValueError, RecursionError):
            return None
        return data if isinstance(data, dict) and "model" in data and "engine" in data else None

    def first_model(self) -> str:
        """The first model a server lists: the default when -m names none."""
        body = self._checked_get(f"{self._base}/models")
        try:
            name = json.loads(body)["data"][0]["id"]
        except (ValueError, KeyError, IndexError, TypeError, RecursionError):
            name = None
        if not isinstance(name, str) or not name:
            raise ServerError(f"{self.url} lists no models", "name one with -m")
        return name

    def stream(self, endpoint: str, body: dict[str, Any]) -> Iterator[dict[str, Any]]:
        """POST with stream: true; yields each server-sent event's JSON object."""
        connection = self._connection(self.timeout_s)
        watchdog = Watchdog(connection, self.timeout_s)  # the first useful event: queue and prefill
        granted = self.timeout_s  # the wait that ran out, when one does
        try:
            try:
                connection.request(
                    "POST", f"{self._base}/{endpoint}", json.dumps({**body, "stream": True}), self._headers()
                )
                response = connection.getresponse()
            except (OSError, http.client.HTTPException) as error:
                if watchdog.expired:
                    raise self._stalled(granted) from None
                raise ServerError(
                    f"cannot reach {self.url}: {peer_text(str(error))}", "is the server running?"
                ) from None
            if response.status != 200:
                raise _error_from(self.url, response.status, _read_capped(response, ERROR_BYTES))
            try:
                while (raw := response.readline(EVENT_BYTES + 1)) and not watchdog.expired:
                    # (A socket shut for reading still gives what keeps coming, on Linux: the
                    # expired deadline ends the loop, not the end of the data.)
                    if len(raw) > EVENT_BYTES:
                        raise StreamBrokenError(f"{self.url} sent an event over {EVENT_BYTES // MiB} MiB")
                    line = raw.decode("utf-8").strip()
                    if not line.startswith("data:"):
                        continue  # comments, event names, keep-alives
                    data = line[5:].strip()
                    if data == "[DONE]":
                        return
                    event = json.loads(data)
                    if not isinstance(event, dict):
                        raise StreamBrokenError(f"{self.url} sent an event that is not a JSON object")
                    if "error" in event:
                        raise _error_from(self.url, 500, data.encode())
                    # The consumer's own time (a paused pager) is not the server's stall.
                    deadline = watchdog.deadline
                    if useful(event):
                        deadline, granted = time.monotonic() + self.stall_s, self.stall_s
                    watchdog.hold()
                    yield event
                    watchdog.arm(deadline)
            except (OSError, http.client.HTTPException, ValueError, RecursionError) as error:
                if not watchdog.expired:
                    reason = peer_text(str(error))
                    raise StreamBrokenError(f"{self.url} broke off the reply ({reason})") from None
            if watchdog.expired:
                raise self._stalled(granted)
            # A stream that ends without [DONE] was cut: the server died, or a proxy dropped it.
            raise StreamBrokenError(
                f"{self.url} ended the reply before it was complete (no [DONE]: the server may have stopped)"
            )
        finally:
            watchdog.stop()
            connection.close()

    def _stalled(self, seconds: float) -> StreamBrokenError:
        return StreamBrokenError(f"{self.url} sent nothing of the reply for {seconds:g} s: it was given up")

    def _get(self, path: str, timeout_s: float) -> tuple[int, bytes]:
        """A GET answered within timeout_s in all (a socket timeout restarts with each byte)."""
        connection = self._connection(timeout_s)
        watchdog = Watchdog(connection, timeout_s)
        try:
            connection.request("GET", path, headers=self._headers())
            response = connection.getresponse()
            if response.status != 200:
                return response.status, _read_capped(response, ERROR_BYTES)
            body = _read_capped(response, BODY_BYTES + 1)
            if len(body) > BODY_BYTES:
                raise ServerError(f"{self.url} answered {path} with more than {BODY_BYTES // MiB} MiB")
            return response.status, body
        except OSError:
            if watchdog.expired:
                raise TimeoutError(f"no answer within {timeout_s:g} s") from None
            raise
        finally:
            watchdog.stop()
            connection.close()

    def _checked_get(self, path: str) -> bytes:
        try:
            status, body = self._get(path, 10.0)
        except (OSError, http.client.HTTPException) as error:
            reason = peer_text(str(error))
            raise ServerError(f"cannot reach {self.url}: {reason}", "is the server running?") from None
        if status != 200:
            raise _error_from(self.url, status, body)
        return body


def useful(event: dict[str, Any]) -> bool:
    """Whether a chunk carries anything: a piece of text, thinking or a call, a finish, the usage.
    An empty delta (the role alone, a keep-alive chunk) is not progress."""
    if event.get("usage"):
        return True
    choices = event.get("choices")
    for choice in choices if isinstance(choices, list) else ():
        if not isinstance(choice, dict):
            continue
        delta = choice.get("delta")
        parts = {k: v for k, v in delta.items() if k != "role"} if isinstance(delta, dict) else {}
        if choice.get("finish_reason") or choice.get("text") or any(parts.values()):
            return True
    return False


class Watchdog:
    """Shuts a connection's socket when its deadline passes, so that a blocked read ends. A socket
    timeout alone would not bound a reply: it restarts with every byte a peer trickles."""

    def __init__(self, connection: http.client.HTTPConnection, seconds: float) -> None:
        self._connection = connection
        self.deadline = time.monotonic() + seconds
        self.expired = False
        self._stopped = False
        self._until = self.deadline  # what the watching thread sleeps until
        self._changed = threading.Condition()
        threading.Thread(target=self._watch, daemon=True, name="llmcli-watchdog").start()

    def arm(self, deadline: float) -> None:
        with self._changed:
            self.deadline = deadline
            if deadline < self._until:  # sooner than the thread wakes: wake it (later needs nothing)
                self._changed.notify()

    def hold(self) -> None:
        """No deadline while the reader is away: its own time is not the peer's."""
        with self._changed:
            self.deadline = float("inf")

    def stop(self) -> None:
        with self._changed:
            self._stopped = True
            self._changed.notify()

    def _watch(self) -> None:
        with self._changed:
            while not self._stopped:
                now = time.monotonic()
                if now >= self.deadline:
                    self.expired = True
                    self._shut()
                    return
                self._until = self.deadline
                self._changed.wait(min(self.deadline - now, 3600.0))

    def _shut(self) -> None:
        sock = self._connection.sock
        if sock is None:  # still connecting: the connection's own timeout bounds that
            return
        # The plain socket's shutdown: an SSL socket's own would drop its state under the reader.
        with contextlib.suppress(OSError):
            socket.socket.shutdown(sock, socket.SHUT_RDWR)


def _read_capped(response: http.client.HTTPResponse, limit: int) -> bytes:
    """At most `limit` bytes of a body; the rest is never read (the connection is closed after)."""
    chunks, size = [], 0
    while size < limit and (chunk := response.read(min(64 * 1024, limit - size))):
        chunks.append(chunk)
        size += len(chunk)
    return b"".join(chunks)


def _error_from(url: str, status: int, body: bytes) -> ServerError:
    """The server's error message (OpenAI's shape, or the body itself), shown as one short line
    in which no control character acts."""
    message = body.decode("utf-8", "replace").strip()
    try:
        error = json.loads(body)["error"]
        message = error["message"] if isinstance(error, dict) else error
    except (ValueError, KeyError, TypeError, RecursionError):
        pass
    return ServerError(f"{url} answered {status}: {peer_text(str(message))}")
