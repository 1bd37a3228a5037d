"""Run llmcli as users do: a real subprocess with real pipes."""

from __future__ import annotations

import os
import subprocess
import sys

LLMCLI = [sys.executable, "-m", "llmcli"]


def run_cli(
    *args: str, stdin: bytes | None = b"", env: dict[str, str] | None = None, timeout: float = 120
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
