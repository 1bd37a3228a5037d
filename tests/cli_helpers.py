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
