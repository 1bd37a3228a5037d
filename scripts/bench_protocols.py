"""What an adapter costs: the same request through each protocol `llmcli serve` speaks, beside
OpenAI's chat route, on one running server.

  python scripts/bench_protocols.py                 # the demo model, 20 requests per protocol
  python scripts/bench_protocols.py --requests 50 -n 8

Each request asks for the same greedy reply (`-n` tokens) to the same message, non-streaming,
over plain HTTP (the standard library: no client library's own cost in the figures); the
protocols take turns, request by request, so the machine's load falls on each alike. Reported:
wall time per request, median (min–max), the ratio to OpenAI's median, and whether every
reply's text equals OpenAI's.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time

MESSAGE = "Name three colours."


def requests(tokens: int) -> dict[str, tuple[str, dict, object]]:
    """protocol → (route, body, how to read the reply's text)."""
    user = [{"role": "user", "content": MESSAGE}]
    return {
        "OpenAI chat": (
            "/v1/chat/completions",
            {"model": "m", "messages": user, "max_tokens": tokens, "temperature": 0},
            lambda r: r["choices"][0]["message"]["content"],
        ),
        "Responses": (
            "/v1/responses",
            {"model": "m", "input": MESSAGE, "max_output_tokens": tokens, "temperature": 0, "store": False},
            lambda r: "".join(p["text"] for i in r["output"] if i["type"] == "message" for p in i["content"]),
        ),
        "Anthropic": (
            "/v1/messages",
            {"model": "m", "messages": user, "max_tokens": tokens, "temperature": 0},
            lambda r: "".join(b["text"] for b in r["content"] if b["type"] == "text"),
        ),
        "Ollama": (
            "/api/chat",
            {
                "model": "m",
                "messages": user,
                "stream": False,
                "options": {"num_predict": tokens, "temperature": 0},
            },
            lambda r: r["message"]["content"],
        ),
    }


def post(host: str, port: int, route: str, body: dict) -> tuple[float, dict]:
    connection = http.client.HTTPConnection(host, port, timeout=120)
    start = time.perf_counter()
    connection.request("POST", route, json.dumps(body), {"Content-Type": "application/json"})
    answer = json.loads(connection.getresponse().read())
    seconds = time.perf_counter() - start
    connection.close()
    return seconds, answer


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("-m", "--model", default=None, help="default: the demo model")
    parser.add_argument("--requests", type=int, default=20)
    parser.add_argument("-n", "--tokens", type=int, default=16)
    args = parser.parse_args()
    command = [sys.executable, "-m", "llmcli", "serve", "--port", "0", "--quiet"]
    if args.model:
        command += ["-m", args.model]
    env = {**os.environ, "XDG_RUNTIME_DIR": tempfile.mkdtemp()}
    server = subprocess.Popen(command, stderr=subprocess.PIPE, env=env)
    try:
        line = ""
        while "Serving" not in line:
            line = server.stderr.readline().decode()
            if not line:
                raise SystemExit("the server did not start")
        url = line.split(" at ", 1)[1].split("/v1", 1)[0]
        host, port = url.removeprefix("http://").split(":")
        asked = requests(args.tokens)
        for route, body, _ in asked.values():  # warm: the first call of each route
            post(host, int(port), route, body)
        times: dict[str, list[float]] = {name: [] for name in asked}
        texts: dict[str, set[str]] = {name: set() for name in asked}
        for _ in range(args.requests):
            for name, (route, body, read) in asked.items():
                seconds, answer = post(host, int(port), route, body)
                times[name].append(seconds)
                texts[name].add(read(answer))
        base = statistics.median(times["OpenAI chat"])
        print(f"{args.requests} requests per protocol, {args.tokens} tokens each, greedy, non-streaming")
        print()
        print("| protocol | route | wall ms per request | ratio to OpenAI chat | same reply |")
        print("|---|---|---:|---:|---|")
        for name, (route, _, _) in asked.items():
            median = statistics.median(times[name])
            spread = f"{median * 1000:.1f} ({min(times[name]) * 1000:.1f}–{max(times[name]) * 1000:.1f})"
            same = "yes" if texts[name] == texts["OpenAI chat"] and len(texts[name]) == 1 else "NO"
            print(f"| {name} | `{route}` | {spread} | {median / base:.3f} | {same} |")
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=30)


if __name__ == "__main__":
    main()
