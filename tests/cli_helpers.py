"""Run llmcli as users do: a real subprocess with real pipes."""

from __future__ import annotations

import os
import subprocess
import sys

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
