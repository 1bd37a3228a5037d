"""Run llmcli as users do: a real subprocess with real pipes."""

from __future__ import annotations

import contextlib
import http.server
import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator

LLMCLI = [sys.executable, "-m", "llmcli"]
# How long a test waits for something to happen before calling it a hang. Not a measure of
# speed: at a load of 6 on two cores a chat that starts in 5 s idle may take a minute, and a
# test waits for its condition, however long the machine takes, up to this.
PATIENCE_S = 600


def run_cli(
    *args: str, stdin: bytes | None = b"", env: dict[str, str] | None = None, timeout: float = PATIENCE_S
) -> subprocess.CompletedProcess[bytes]:
    """`stdin=None` leaves stdin closed-ish (/dev/null); bytes are piped in."""
    return subprocess.run(
        [*LLMCLI, *args],
        input=stdin,
        stdin=subprocess.DEVNULL if stdin is None else None,
        capture_output=True,
        env={**os.environ, **(env or {})},
        timeout=timeout,
    )


def one_error_line(proc, code: int) -> str:
    err = proc.stderr.decode()
    assert proc.returncode == code, (proc.returncode, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("llmcli: error: "), err
    assert "unexpected" not in err and "Traceback" not in err
    return lines[0]


# llmcli's command line in a process that ends its stderr with "exit CODE imported NAMES": which
# of transformers and accelerate the call left imported ("-" for neither).
_REPORTING_IMPORTS = (
    "import sys\n"
    "from llmcli.cli.entry import run_command_line\n"
    "code = run_command_line(sys.argv[1:])\n"
    "loaded = sorted({m.split('.')[0] for m in sys.modules} & {'transformers', 'accelerate'})\n"
    "print('\\nexit', code, 'imported', ','.join(loaded) or '-', file=sys.stderr)\n"
)
# The same, then a last line "torch imported" or "torch not imported".
_REPORTING_TORCH = _REPORTING_IMPORTS + (
    "print('torch imported' if 'torch' in sys.modules else 'torch not imported', file=sys.stderr)\n"
)


def run_reporting_imports(
    *args: str, env: dict[str, str] | None = None, torch: bool = False
) -> subprocess.CompletedProcess[str]:
    """`llmcli ARGS`, in-process as the console script runs it, its stderr ending with which of
    transformers and accelerate it imported (`exit 0 imported -`: neither); with `torch`, then a
    line saying whether torch was (`torch not imported`)."""
    return subprocess.run(
        [sys.executable, "-c", _REPORTING_TORCH if torch else _REPORTING_IMPORTS, *args],
        capture_output=True,
        text=True,
        timeout=PATIENCE_S,
        env={**os.environ, **(env or {})},
    )


def send_one_chunk(handler: http.server.BaseHTTPRequestHandler, delta: dict, finish: str) -> None:
    """A stand-in OpenAI-style server's whole streamed reply: one chunk (text or calls), then
    [DONE]."""
    chunk = {"choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
    handler.send_response(200)
    handler.send_header("Content-Type", "text/event-stream")
    handler.end_headers()
    handler.wfile.write(f"data: {json.dumps(chunk)}\n\ndata: [DONE]\n\n".encode())


@contextlib.contextmanager
def local_http_server(handler: type[http.server.BaseHTTPRequestHandler]) -> Iterator[str]:
    """A stand-in HTTP server on 127.0.0.1 (a peer that misbehaves, a program on another port),
    each request in a thread of its own; its URL, and it is shut down at the end."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
