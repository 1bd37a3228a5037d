"""The HTTP API over the models a server holds (FastAPI on uvicorn; which model a request names:
fleet.py), composed here: the routes of OpenAI's chat and text completions (openai.py), of the
Responses, Anthropic and Ollama APIs (responses.py, anthropic.py, ollama.py), the guards around
them (guard.py, BodyLimit), and every failure as an error object in the protocol's own shape.
Nothing imports this module.

Each route reads its protocol's request and answers it through answers.py: the prompt made and
checked (prompts.py), the generations run (worker.py), and their protocol-neutral events
(events.py) encoded by the route's own encoder, streamed or whole; Anthropic's blocks and the
Responses API's items are grouped by one rule (blocks.py). No route reads another's output.

Generations run on threads of their own, taking turns on their model's compute thread
(engine/scheduler.py): with --parallel above 1 each runs on an engine of its own and their decode
steps are batched, else one runs at a time. An engine's cache persists between requests: a
request whose prompt starts with what a cache holds (the next turn of a chat, re-sent whole by
any client) prefills only the rest, and `usage.prompt_tokens_details.cached_tokens` says how
much was reused.

A client that goes away stops its generation at the next token (the engine's cache is cropped
back to what it holds exactly, as after Ctrl-C); one still waiting in the queue is skipped, and
the queue is bounded. The generation threads live on after any failure.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from llmcli.errors import LlmcliError
from llmcli.server.anthropic import install_anthropic
from llmcli.server.fleet import Fleet
from llmcli.server.guard import HostGuard, JsonOnly, KeyGuard, NestingLimit
from llmcli.server.hosted_tools import HostedTools
from llmcli.server.metrics import Observed
from llmcli.server.ollama import install_ollama
from llmcli.server.openai import install_openai
from llmcli.server.protocol import error_for
from llmcli.server.responses import install_responses
from llmcli.server.state import RequestError, Served, describe

MAX_BODY_BYTES = 8 << 20  # a prompt of ~2M tokens: larger is a mistake, not a prompt


def create_app(fleet: Fleet, served: Served) -> ASGIApp:
    """The app over `fleet`'s models; `served` holds what they all share (who may call, the
    metrics, the shutdown), no model."""
    app = FastAPI(title="llmcli", docs_url=None, redoc_url=None, openapi_url=None)
    _install_error_handlers(app)

    @app.get("/health")
    async def health() -> dict[str, Any]:
        latest = next(fleet.loaded(), None)  # the most recently used model: what a call gets by default
        described = latest.info() if latest is not None else {"model": None, "engine": None}
        return {"status": "ok", **described, "instance": served.instance, "models": fleet.states()}

    @app.get("/metrics")
    async def metrics() -> Response:
        from prometheus_client import CONTENT_TYPE_LATEST

        return Response(served.metrics.text(), media_type=CONTENT_TYPE_LATEST)

    install_openai(app, fleet)
    install_ollama(app, fleet)
    hosted = HostedTools(drop=served.drop_hosted_tools)  # one for both: each type said once
    install_anthropic(app, fleet, hosted)
    install_responses(app, fleet, hosted)

    guarded: ASGIApp = KeyGuard(JsonOnly(NestingLimit(app)), served.api_key)
    if served.cors:
        from starlette.middleware.cors import CORSMiddleware

        guarded = CORSMiddleware(
            guarded, allow_origins=list(served.cors), allow_methods=["*"], allow_headers=["*"]
        )
    limited = BodyLimit(HostGuard(guarded, served.host, served.allowed_hosts, served.cors), MAX_BODY_BYTES)
    return Observed(limited, served.metrics, served.quiet)


def _error(
    path: str, status: int, message: str, param: str | None = None, code: str | None = None
) -> JSONResponse:
    return JSONResponse(error_for(path, status, message, param, code), status_code=status)


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, error: RequestValidationError) -> JSONResponse:
        problems = error.errors()
        first = problems[0] if problems else {}
        if first.get("type") == "json_invalid":
            return _answer(request, 400, "the request body is not valid JSON", code="invalid_json")
        where = ".".join(str(part) for part in first.get("loc", ())[1:]) or None
        if first.get("type") == "extra_forbidden":
            return _answer(request, 400, f"{where} is not supported here", where, "unknown_parameter")
        # 400, as OpenAI answers a bad value (FastAPI's own would be 422), naming the parameter.
        return _answer(
            request, 400, f"{where or 'body'}: {first.get('msg', 'invalid value')}", where, "invalid_value"
        )

    @app.exception_handler(RequestError)
    async def refused(request: Request, error: RequestError) -> JSONResponse:
        _release(request)
        response = _answer(request, error.status, error.message, error.param, error.code)
        response.headers.update(error.headers or {})
        return response

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, error: HTTPException) -> JSONResponse:
        if error.status_code == 404:
            return _answer(
                request, 404, f"no route {request.method} {request.url.path} here (see GET /v1/models)"
            )
        if error.status_code == 405:
            return _answer(request, 405, f"{request.url.path} does not take {request.method}")
        return _answer(request, error.status_code, str(error.detail))

    @app.exception_handler(LlmcliError)
    async def llmcli_error(request: Request, error: LlmcliError) -> JSONResponse:
        _release(request)
        return _answer(request, 400, error.one_line())

    @app.exception_handler(Exception)
    async def crashed(request: Request, error: Exception) -> JSONResponse:
        _release(request)
        return _answer(request, 500, describe(error))


def _answer(
    request: Request, status: int, message: str, param: str | None = None, code: str | None = None
) -> JSONResponse:
    """An error in the shape of the protocol the request spoke (protocol.error_for)."""
    return _error(request.url.path, status, message, param, code)


def _release(request: Request) -> None:
    """A request that failed before its generation started gives its place in the queue back."""
    ticket = getattr(request.state, "ticket", None)
    if ticket is not None:
        ticket.release()


class BodyLimit:
    """413 for a body over `limit` bytes, by its Content-Length or, when chunked, as it arrives."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers", ())).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            await self._too_large(scope, receive, send)
            return
        seen, started, too_large = 0, False, False

        async def counting_receive() -> Any:
            nonlocal seen, too_large
            if too_large:
                return {"type": "http.disconnect"}
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.limit:  # the app stops reading here; its answer is replaced by a 413
                    too_large = True
                    return {"type": "http.disconnect"}
            return message

        async def tracking_send(message: Any) -> None:
            nonlocal started
            if too_large:
                return
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counting_receive, tracking_send)
        except Exception as error:  # answered already by the handlers: no traceback on stderr
            if not started and not too_large:
                await _error(scope["path"], 500, describe(error))(scope, receive, send)
        if too_large and not started:
            await self._too_large(scope, receive, send)

    async def _too_large(self, scope: Scope, receive: Receive, send: Send) -> None:
        message = f"the request body is over {self.limit} bytes"
        await _error(scope["path"], 413, message)(scope, receive, send)
