"""What an adapter costs: the same request through each protocol `llmcli serve` speaks, beside
OpenAI's chat route, on one running server — for this checkout and, beside it in the same run,
an earlier commit (--baseline REV, checked out into a temporary worktree).

  python scripts/bench_protocols.py                      # the demo model, 20 requests per protocol
  python scripts/bench_protocols.py --stream -n 64       # streamed replies, read to their end
  python scripts/bench_protocols.py --baseline main~3    # this checkout beside an earlier commit

Each request asks for the same greedy reply (`-n` tokens) to the same message over plain HTTP
(the standard library: no client library's own cost in the figures); with --stream each reply
streams in its protocol's own shape (SSE or NDJSON) and is read to its end. Protocols and
sources take turns, request by request, so the machine's load falls on each alike. Reported:
wall time per request, median (min–max), its ratio to OpenAI chat on the same server and to the
same protocol on the baseline, and whether every reply's text equals OpenAI's.
"""

from __future__ import annotations

import argparse
import http.client
import json
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from bench_interleaved import start
from checkouts import checkouts

MESSAGE = "Name three colours."


def requests(tokens: int, stream: bool) -> dict[str, tuple[str, dict, Callable[[bytes], str]]]:
    """protocol → (route, body, how to read the reply's text from the whole body)."""
    user = [{"role": "user", "content": MESSAGE}]
    return {
        "OpenAI chat": (
            "/v1/chat/completions",
            {"model": "m", "messages": user, "max_tokens": tokens, "temperature": 0, "stream": stream},
            streamed_openai if stream else lambda b: json.loads(b)["choices"][0]["message"]["content"],
        ),
        "Responses": (
            "/v1/responses",
            {
                "model": "m",
                "input": MESSAGE,
                "max_output_tokens": tokens,
                "temperature": 0,
                "store": False,
                "stream": stream,
            },
            streamed_responses if stream else whole_responses,
        ),
        "Anthropic": (
            "/v1/messages",
            {"model": "m", "messages": user, "max_tokens": tokens, "temperature": 0, "stream": stream},
            streamed_anthropic if stream else whole_anthropic,
        ),
        "Ollama": (
            "/api/chat",
            {
                "model": "m",
                "messages": user,
                "stream": stream,
                "options": {"num_predict": tokens, "temperature": 0},
            },
            streamed_ollama if stream else lambda b: json.loads(b)["message"]["content"],
        ),
    }


def whole_responses(body: bytes) -> str:
    reply = json.loads(body)
    return "".join(p["text"] for i in reply["output"] if i["type"] == "message" for p in i["content"])


def whole_anthropic(body: bytes) -> str:
    return "".join(b["text"] for b in json.loads(body)["content"] if b["type"] == "text")


def sse_data(body: bytes) -> list[dict]:
    lines = body.decode().splitlines()
    return [json.loads(line[6:]) for line in lines if line.startswith("data: ") and line != "data: [DONE]"]


def streamed_openai(body: bytes) -> str:
    return "".join(
        (choice.get("delta") or {}).get("content") or ""
        for event in sse_data(body)
        for choice in event.get("choices") or ()
    )


def streamed_responses(body: bytes) -> str:
    return "".join(e["delta"] for e in sse_data(body) if e.get("type") == "response.output_text.delta")


def streamed_anthropic(body: bytes) -> str:
    return "".join(
        e["delta"]["text"]
        for e in sse_data(body)
        if e.get("type") == "content_block_delta" and e["delta"].get("type") == "text_delta"
    )


def streamed_ollama(body: bytes) -> str:
    return "".join(json.loads(line)["message"]["content"] for line in body.decode().splitlines() if line)


def post(address: str, route: str, body: dict) -> tuple[float, bytes]:
    host, port = address.rsplit(":", 1)
    connection = http.client.HTTPConnection(host, int(port), timeout=120)
    start_at = time.perf_counter()
    connection.request("POST", route, json.dumps(body), {"Content-Type": "application/json"})
    answer = connection.getresponse().read()
    seconds = time.perf_counter() - start_at
    connection.close()
    return seconds, answer


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("-m", "--model", default=None, help="default: the demo model")
    parser.add_argument("--requests", type=int, default=20)
    parser.add_argument("-n", "--tokens", type=int, default=16)
    parser.add_argument("--stream", action="store_true", help="streamed replies, read to their end")
    parser.add_argument("--baseline", help="a git revision to measure beside this checkout")
    args = parser.parse_args()
    asked = requests(args.tokens, args.stream)
    times: dict[tuple[str, str], list[float]] = {}
    texts: dict[tuple[str, str], set[str]] = {}
    with tempfile.TemporaryDirectory() as scratch, checkouts(args.baseline, scratch) as sources:
        servers: dict[str, tuple] = {}
        try:
            for name, source in sources.items():
                servers[name] = start(Path(source), args, tempfile.mkdtemp(dir=scratch))
            for _, address in servers.values():  # warm: the first call of each route
                for route, body, _ in asked.values():
                    post(address, route, body)
            for _ in range(args.requests):
                for protocol, (route, body, read) in asked.items():
                    for name, (_, address) in servers.items():
                        seconds, answer = post(address, route, body)
                        times.setdefault((name, protocol), []).append(seconds)
                        texts.setdefault((name, protocol), set()).add(read(answer))
        finally:
            for server, _ in servers.values():
                server.terminate()
                server.wait(timeout=30)
    mode = "streamed" if args.stream else "non-streaming"
    print(f"{args.requests} requests per protocol and source, {args.tokens} tokens each, greedy, {mode}")
    print()
    print("| source | protocol | route | wall ms per request | to OpenAI chat | to baseline | same reply |")
    print("|---|---|---|---:|---:|---:|---|")
    baseline = next((name for name in sources if name.startswith("baseline")), None)
    for name in sources:
        base = statistics.median(times[(name, "OpenAI chat")])
        for protocol, (route, _, _) in asked.items():
            spent = times[(name, protocol)]
            median = statistics.median(spent)
            spread = f"{median * 1000:.1f} ({min(spent) * 1000:.1f}–{max(spent) * 1000:.1f})"
            against = f"{median / statistics.median(times[(baseline, protocol)]):.3f}" if baseline else "–"
            said = texts[(name, protocol)]
            same = "yes" if said == texts[(name, "OpenAI chat")] and len(said) == 1 else "NO"
            ratio = f"{median / base:.3f}"
            print(f"| {name} | {protocol} | `{route}` | {spread} | {ratio} | {against} | {same} |")


if __name__ == "__main__":
    main()
