"""Who may talk to the server: the requests a web page in a browser could make are refused.

A page on another site can reach a server on 127.0.0.1 in two ways: by DNS rebinding (its own
name, re-pointed at 127.0.0.1, so the browser sends `Host: evil.example`) and by a cross-origin
request (the browser sends its `Origin`). So a request whose Host is not an address the server
answers on, `localhost` or a name given with --allowed-hosts, and one that carries an Origin
not given with --cors, is a 403 before it reaches any route. With --cors the allowed origins get
CORS headers (Starlette's CORSMiddleware); without it there are none. A body that is not
declared JSON (a form, a multipart upload, text/plain: what a page can post without asking) is
refused too, and so is one nested deeper than any request needs (a parser, a validator or a
template recursing through it would run out of stack). Each refusal comes in the shape of the
protocol its path speaks.
"""

from __future__ import annotations

import ipaddress
import json
import re
from collections.abc import Iterable
from itertools import accumulate
from typing import Any

from starlette.types import ASGIApp, Receive, Scope, Send

from llmcli.server.protocol import error_for

LOCAL_NAMES = frozenset({"localhost", "localhost.", "ip6-localhost"})
# Arrays and objects inside each other, at most: a tool's JSON schema nests a few levels per
# level of its value; Python's recursion (a parser, pydantic, a template) gives out near 1,000.
MAX_DEPTH = 64
STRINGS = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')  # a bracket inside a string is text
NOT_BRACKETS = bytes(byte for byte in range(256) if byte not in b"[]{}")
STEP = {ord("["): 1, ord("{"): 1, ord("]"): -1, ord("}"): -1}


class HostGuard:
    def __init__(
        self, app: ASGIApp, bound_host: str, allowed_hosts: Iterable[str] = (), origins: Iterable[str] = ()
    ) -> None:
        self.app = app
        self.bound = _address(bound_host)
        self.names = LOCAL_NAMES | {name.lower() for name in allowed_hosts}
        self.origins = frozenset(origin.rstrip("/") for origin in origins)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers", ()))
        host = headers.get(b"host", b"").decode("latin-1")
        origin = headers.get(b"origin")
        if host and not self.host_allowed(host):
            why = (
                f"Host {host!r} is not an address this server answers on (start it with --allowed-hosts NAME)"
            )
            await _forbidden(scope, why, send)
            return
        if origin is not None and origin.decode("latin-1").rstrip("/") not in self.origins:
            page = origin.decode("latin-1")
            why = f"requests from web pages at {page!r} are refused (start the server with --cors ORIGIN)"
            await _forbidden(scope, why, send)
            return
        await self.app(scope, receive, send)

    def host_allowed(self, host: str) -> bool:
        """The Host header without its port: a local name, an allowed name, or an address this
        server can be reached at (a loopback one, the bound one, any when bound to all)."""
        name = host[1 : host.find("]")] if host.startswith("[") else host.rsplit(":", 1)[0]
        if name.lower() in self.names:
            return True
        address = _address(name)
        if address is None:
            return False
        return address.is_loopback or self.bound is None or self.bound.is_unspecified or address == self.bound


def _address(text: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(text.strip("[]"))
    except ValueError:
        return None


async def _forbidden(scope: Scope, message: str, send: Send) -> None:
    await refuse(scope, 403, message, "forbidden", send)


async def refuse(scope: Scope, status: int, message: str, code: str, send: Send) -> None:
    """An answer before any route: in the shape of the protocol the path speaks."""
    body = json.dumps(error_for(scope.get("path", ""), status, message, code=code))
    headers = [(b"content-type", b"application/json")]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body.encode()})


class KeyGuard:
    """401 for any request without the server's key: `Authorization: Bearer KEY`, or
    Anthropic's `x-api-key: KEY` — /health and /metrics too, which name the model and the device.
    Pure ASGI: Starlette's BaseHTTPMiddleware holds streamed responses back at shutdown."""

    def __init__(self, app: ASGIApp, api_key: str | None) -> None:
        self.app = app
        self.key = api_key.encode() if api_key else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        guarded = self.key is not None and scope["type"] == "http"
        headers = dict(scope.get("headers", ())) if guarded else {}
        given = (headers.get(b"authorization", b""), headers.get(b"x-api-key", b""))
        if guarded and b"Bearer " + self.key not in given and self.key not in given:
            message = "a valid API key is required (Authorization: Bearer …)"
            await refuse(scope, 401, message, "invalid_api_key", send)
            return
        await self.app(scope, receive, send)


class JsonOnly:
    """400 for a body whose Content-Type is not JSON: every route reads JSON, and a form,
    multipart or text/plain body is what a web page can post to any address without asking
    first. A body without a Content-Type is read as JSON, as FastAPI does."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope.get("method") not in ("GET", "HEAD", "OPTIONS"):
            declared = dict(scope.get("headers", ())).get(b"content-type")
            kind = (declared or b"").split(b";")[0].strip().lower().decode("latin-1")
            if declared is not None and kind != "application/json" and not kind.endswith("+json"):
                message = (
                    f"the request body is {kind or 'untyped'}: send JSON, with Content-Type: application/json"
                )
                await refuse(scope, 400, message, "invalid_content_type", send)
                return
        await self.app(scope, receive, send)


def nesting(raw: bytes) -> int:
    """How deep a JSON text's arrays and objects go, without parsing it (a parser would
    recurse): its strings taken out, then its brackets counted, in C loops."""
    brackets = STRINGS.sub(b"", raw).translate(None, NOT_BRACKETS)
    return max(accumulate(map(STEP.__getitem__, brackets)), default=0)


class NestingLimit:
    """400 for a body nested over MAX_DEPTH, checked before any route parses it. The body is
    read whole (BodyLimit, outside, bounds it) and handed on as it came."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("method") in ("GET", "HEAD", "OPTIONS"):
            await self.app(scope, receive, send)
            return
        pieces = []
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left, or BodyLimit cut the body off
                return
            pieces.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
        raw = b"".join(pieces)
        depth = nesting(raw)
        if depth > MAX_DEPTH:
            message = f"the request body is nested {depth} levels deep: at most {MAX_DEPTH} here"
            await refuse(scope, 400, message, "nested_too_deep", send)
            return
        handed = False

        async def replay() -> Any:
            nonlocal handed
            if handed:
                return await receive()  # after the body: a disconnect, when it comes
            handed = True
            return {"type": "http.request", "body": raw, "more_body": False}

        await self.app(scope, replay, send)
