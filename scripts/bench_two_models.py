"""Two models in one `llmcli serve`: the latency of requests to the loaded model alone, and while
the server loads the other model (its load on a thread of its own, server/fleet.py).

One server holds model A (`-m`, the demo by default) with --models-max 2; model B is a config
alias. Each run: requests to A alone; then B's load started by a request naming it, and
requests to A sent until B is loaded (only those that ended while /api/ps still said B was
loading count: B's own first reply, which follows, is not its load); then requests to A with
B held and idle (its compute thread beside A's); then B unloaded (Ollama's keep_alive 0) for
the next run. Every request to A is the same greedy chat (--max-tokens). The table gives, per
run and over all, the median and the spread (min–max) of A's latency in each condition, side
by side, and each median's ratio to A alone.

  python scripts/bench_two_models.py                       # A: the demo; B: a copy of its GGUF file
  python scripts/bench_two_models.py -a ./model-a -b ./model-b --runs 10 --alone 8
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

ASK = [{"role": "user", "content": "Name three colours."}]


def post(url: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
    request = urllib.request.Request(
        url + path, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=600) as answer:
        return json.loads(answer.read())


def state(url: str, name: str) -> str | None:
    with urllib.request.urlopen(url + "/api/ps", timeout=60) as answer:
        held = json.loads(answer.read())["models"]
    return next((entry["state"] for entry in held if entry["name"] == name), None)


def timed(url: str, max_tokens: int) -> float:
    started = time.perf_counter()
    post(
        url,
        "/v1/chat/completions",
        {"model": "a", "messages": ASK, "max_tokens": max_tokens, "temperature": 0},
    )
    return time.perf_counter() - started


def start(model_a: str, model_b: str, folder: Path) -> tuple[subprocess.Popen[bytes], str]:
    config = folder / "config.toml"
    config.write_text(f"[aliases]\na = {json.dumps(model_a)}\nb = {json.dumps(model_b)}\n")
    env = {**os.environ, "LLMCLI_CONFIG": str(config), "XDG_RUNTIME_DIR": str(folder)}
    command = [
        sys.executable,
        "-m",
        "llmcli",
        "serve",
        "-m",
        model_a,
        "--port",
        "0",
        "--models-max",
        "2",
        "--quiet",
    ]
    server = subprocess.Popen(command, stderr=subprocess.PIPE, env=env)
    assert server.stderr is not None
    for line in server.stderr:
        if b"Serving" in line:
            return server, line.decode().split(" at ", 1)[1].split("/v1", 1)[0]
    raise SystemExit(f"the server did not start: {server.stderr.read().decode()}")


Latencies = list[float]


def one_run(url: str, spec_b: str, alone_count: int, tokens: int) -> tuple[Latencies, Latencies, Latencies]:
    alone = [timed(url, tokens) for _ in range(alone_count)]
    replies: list[dict[str, Any]] = []
    loading = threading.Thread(
        target=lambda: replies.append(
            post(url, "/v1/chat/completions", {"model": "b", "messages": ASK, "max_tokens": 1})
        )
    )
    loading.start()
    while state(url, spec_b) != "loading" and loading.is_alive():  # B's load has begun (named so)
        time.sleep(0.01)
    during = []
    while loading.is_alive():
        latency = timed(url, tokens)
        if state(url, spec_b) != "loading":  # B is loaded (and answering its own request): done
            break
        during.append(latency)  # it ended while B was still loading
    loading.join()
    name = replies[0]["model"]
    # B held and idle: its compute thread (and OpenMP team) beside A's, nothing running on it.
    beside = [timed(url, tokens) for _ in range(alone_count)]
    post(url, "/api/generate", {"model": "b", "keep_alive": 0})  # unloaded, for the next run's load
    while state(url, name) is not None:
        time.sleep(0.01)
    return alone, during, beside


def table_row(run: str, alone: list[float], during: list[float], beside: list[float]) -> tuple[str, ...]:
    def ratio(values: list[float]) -> str:
        return f"{statistics.median(values) / statistics.median(alone):.2f}" if values else "—"

    return (run, spread(alone), spread(during), ratio(during), spread(beside), ratio(beside))


def spread(values: list[float]) -> str:
    if not values:
        return "—"
    low, high = min(values) * 1000, max(values) * 1000
    return f"{statistics.median(values) * 1000:.1f} ms ({low:.0f}–{high:.0f}, n={len(values)})"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("-a", help="the loaded model (default: the demo)")
    parser.add_argument("-b", help="the model loaded meanwhile (default: a copy of the demo's GGUF file)")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--alone", type=int, default=5, help="requests to A alone per run")
    parser.add_argument("--max-tokens", type=int, default=16)
    options = parser.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="bench-two-models-"))
    from llmcli.models.resolve import demo_gguf_path

    demo = demo_gguf_path()
    model_a = options.a or str(demo)
    model_b = options.b
    if model_b is None:  # another file: another model to the server, loaded and converted anew
        model_b = str(folder / "other.gguf")
        shutil.copyfile(str(demo), model_b)
    server, url = start(model_a, model_b, folder)
    try:
        timed(url, options.max_tokens)  # warm: A's first request
        rows, every = [], ([], [], [])
        for run in range(options.runs):
            measured = one_run(url, model_b, options.alone, options.max_tokens)
            for kept, new in zip(every, measured, strict=True):
                kept += new
            rows.append(table_row(str(run + 1), *measured))
        rows.append(table_row("all", *every))
        header = ("run", "A alone", "A while B loads", "ratio", "A with B held, idle", "ratio")
        widths = [max(len(line[i]) for line in [header, *rows]) for i in range(len(header))]
        print(f"A = {model_a}\nB = {model_b}\n{options.max_tokens} tokens per request, greedy")
        print("latency of A's requests: median (min–max, count); ratio: of the medians to A alone\n")
        for line in [header, *rows]:
            print(" | ".join(cell.ljust(width) for cell, width in zip(line, widths, strict=True)))
    finally:
        server.terminate()
        server.wait(timeout=60)
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
