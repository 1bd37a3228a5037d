"""How long `llmcli generate -m ORG/NAME` takes to give up on a Hub that takes the connection
and never answers (a hung network, on loopback): wall time of the whole command, median of
--runs with the lowest and highest beside it, against llmcli's own bound (HUB_TIMEOUT_S, plus
the half second it waits for the worker thread). The tests check that the bound is what ends
it (tests/test_resolve.py); how long that takes on a machine is this script's figure.

    python scripts/bench_hub_timeout.py [--runs 5]
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time

from llmcli.models.resolve import HUB_TIMEOUT_S


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(64)  # the backlog takes each connection; nothing ever reads or answers it
    home = tempfile.mkdtemp(prefix="llmcli-hub-timeout-")
    env = {
        **os.environ,
        "HF_ENDPOINT": f"http://127.0.0.1:{server.getsockname()[1]}",
        "HF_HUB_OFFLINE": "0",
        "HF_HOME": os.path.join(home, "hf"),
        "XDG_CACHE_HOME": os.path.join(home, "cache"),
    }
    seconds = []
    for _ in range(args.runs):
        started = time.perf_counter()
        proc = subprocess.run(
            [sys.executable, "-m", "llmcli", "generate", "-m", "some-org/some-model", "hi"],
            capture_output=True,
            env=env,
        )
        seconds.append(time.perf_counter() - started)
        if b"did not answer" not in proc.stderr:
            sys.exit(f"unexpected outcome: {proc.stderr.decode().strip()}")
    print(
        f"gave up after {statistics.median(seconds):.2f} s "
        f"({min(seconds):.2f}–{max(seconds):.2f}, {args.runs} runs); bound {HUB_TIMEOUT_S + 0.5:.1f} s"
    )


if __name__ == "__main__":
    main()
