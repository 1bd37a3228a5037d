"""A small OpenAI-API client on the standard library: what `generate` uses to reach a server.

Made for start-up time, not features: http.client and json import in milliseconds, where the
`openai` package (or httpx) would cost more than a warm server's whole answer. It speaks to
llmcli's own server and to any OpenAI-compatible one (vLLM, llama.cpp's server, ollama, SGLang).
"""

from __future__ import annotations

import http.client
import json
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit

from llmcli.errors import LlmcliError

# Sampling settings whose name in the OpenAI API differs from llmcli's; the others (top_k, min_p,
# repetition_penalty: extras vLLM and llama.cpp's server read too) travel under their own names.
OPENAI_NAMES = {"max_new_tokens": "max_tokens"}


class ServerError(LlmcliError):
    """The server answered with an error, or could not be reached."""


class StreamBrokenError(ServerError):
    """A reply stopped before the server said it was complete: what came is a part of it."""


class Client:
    def __init__(self, url: str, api_key: str | None = None, timeout_s: float = 600.0) -> None:
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
        except (OSError, http.client.HTTPException):
            return None
        if status != 200:
            return None
        try:
            data = json.loads(body)
        except ValueError:
            return None
        return data if isinstance(data, dict) and "model" in data and "engine" in data else None

    def first_model(self) -> str:
        """The first model a server lists: the default when -m names none."""
        body = self._checked_get(f"{self._base}/models")
        try:
            return str(json.loads(body)["data"][0]["id"])
        except (ValueError, KeyError, IndexError, TypeError):
            raise ServerError(f"{self.url} lists no models", "name one with -m") from None

    def stream(self, endpoint: str, body: dict[str, Any]) -> Iterator[dict[str, Any]]:
        """POST with stream: true; yields each server-sent event's JSON object."""
        connection = self._connection(self.timeout_s)
        try:
            try:
                connection.request(
                    "POST", f"{self._base}/{endpoint}", json.dumps({**body, "stream": True}), self._headers()
                )
                response = connection.getresponse()
            except OSError as error:
                raise ServerError(f"cannot reach {self.url}: {error}", "is the server running?") from None
            if response.status != 200:
                raise _error_from(self.url, response.status, response.read())
            try:
                for raw in response:
                    line = raw.decode("utf-8").strip()
                    if not line.startswith("data:"):
                        continue  # comments, event names, keep-alives
                    data = line[5:].strip()
                    if data == "[DONE]":
                        return
                    event = json.loads(data)
                    if isinstance(event, dict) and "error" in event:
                        raise _error_from(self.url, 500, data.encode())
                    yield event
            except (OSError, http.client.HTTPException, ValueError) as error:
                raise StreamBrokenError(f"{self.url} broke off the reply ({error})") from None
            # A stream that ends without [DONE] was cut: the server died, or a proxy dropped it.
            raise StreamBrokenError(
                f"{self.url} ended the reply before it was complete (no [DONE]: the server may have stopped)"
            )
        finally:
            connection.close()

    def _get(self, path: str, timeout_s: float) -> tuple[int, bytes]:
        connection = self._connection(timeout_s)
        try:
            connection.request("GET", path, headers=self._headers())
            response = connection.getresponse()
            return response.status, response.read()
        finally:
            connection.close()

    def _checked_get(self, path: str) -> bytes:
        try:
            status, body = self._get(path, 10.0)
        except (OSError, http.client.HTTPException) as error:
            raise ServerError(f"cannot reach {self.url}: {error}", "is the server running?") from None
        if status != 200:
            raise _error_from(self.url, status, body)
        return body


def _error_from(url: str, status: int, body: bytes) -> ServerError:
    message = body.decode("utf-8", "replace").strip()[:300]
    try:
        error = json.loads(body)["error"]
        message = error["message"] if isinstance(error, dict) else str(error)
    except (ValueError, KeyError, TypeError):
        pass
    return ServerError(f"{url} answered {status}: {message}")
