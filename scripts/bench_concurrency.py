"""Streaming clients at once on one `llmcli serve`: aggregate decode speed and time to the first
token at each concurrency, for this checkout and, beside it in the same run, an earlier commit
(--baseline REV, checked out into a temporary worktree); and the time to the first token of a
short request sent alone and sent while 3 clients stream.

At each concurrency C (--concurrency 1,2,4) C clients each stream --requests greedy replies of
-n tokens (each client its own prompt, so no prefix is shared), all started together. Reported
per source and C: aggregate tok/s (completion tokens over the wall time, median of --runs with
the lowest and highest beside it; `×1` is its ratio to C = 1 of the same source) and the
median time to the first streamed token of every request.

    python scripts/bench_concurrency.py [--baseline REV] [-m MODEL] [--concurrency 1,2,4]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import threading
import time

from bench_interleaved import start
from checkouts import checkouts
from llmcli.server.client import Client

PROMPTS = [
    "Write a short poem about the sea.",
    "Explain what a CPU cache is.",
    "List three fruits and their colours.",
    "Describe a sunrise in the mountains.",
    "What makes bread rise?",
    "Tell me a fact about owls.",
    "How do bicycles stay upright?",
    "Name a famous painting and its painter.",
]


def clients_at_once(address: str, count: int, args: argparse.Namespace) -> tuple[float, list[float]]:
    """(aggregate tok/s, each request's time to its first token)"""
    tokens, first_tokens = [0], []
    lock = threading.Lock()

    def client(prompt: str) -> None:
        session = Client(f"http://{address}")
        body = {
            "messages": [{"role": "user", "content": prompt}],
            "temperature": 0,
            "max_tokens": args.new_tokens,
            "stream_options": {"include_usage": True},
        }
        for _ in range(args.requests):
            started, first = time.perf_counter(), None
            for event in session.stream("chat/completions", body):
                texts = [(choice.get("delta") or {}).get("content") for choice in event.get("choices") or ()]
                if first is None and any(texts):
                    first = time.perf_counter() - started
                if event.get("usage"):
                    with lock:
                        tokens[0] += event["usage"]["completion_tokens"]
            with lock:
                first_tokens.append(first or 0.0)

    threads = [threading.Thread(target=client, args=(PROMPTS[n % len(PROMPTS)],)) for n in range(count)]
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return tokens[0] / (time.perf_counter() - started), first_tokens


def joining(address: str, others: int, args: argparse.Namespace) -> list[float]:
    """Times to the first token of --requests requests, one after another, each sent while
    `others` clients stream long replies."""
    going, streaming, firsts = threading.Event(), threading.Semaphore(0), []
    going.set()

    def streamer(prompt: str) -> None:
        session = Client(f"http://{address}")
        body = {"messages": [{"role": "user", "content": prompt}], "temperature": 0, "max_tokens": 256}
        told = False
        while going.is_set():
            for _ in session.stream("chat/completions", body):
                if not told:
                    streaming.release()  # its first event: this one is streaming
                    told = True

    threads = [threading.Thread(target=streamer, args=(PROMPTS[n + 1],)) for n in range(others)]
    for thread in threads:
        thread.start()
    session = Client(f"http://{address}")
    body = {"messages": [{"role": "user", "content": PROMPTS[0]}], "temperature": 0, "max_tokens": 4}
    try:
        for _ in range(others):
            streaming.acquire()
        for _ in range(args.requests * 3):
            started = time.perf_counter()
            for event in session.stream("chat/completions", body):
                if any((choice.get("delta") or {}).get("content") for choice in event.get("choices") or ()):
                    firsts.append(time.perf_counter() - started)
                    break
    finally:
        going.clear()
        for thread in threads:
            thread.join()
    return firsts


def cell(values: list[float], digits: int) -> str:
    return f"{statistics.median(values):.{digits}f} ({min(values):.{digits}f}–{max(values):.{digits}f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", help="a git revision to measure beside this checkout")
    parser.add_argument("-m", "--model", help="the model (default: the demo)")
    parser.add_argument("--concurrency", default="1,2,4")
    parser.add_argument("--requests", type=int, default=3, help="requests per client")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("-n", "--new-tokens", type=int, default=64)
    args = parser.parse_args()
    levels = [int(level) for level in args.concurrency.split(",")]
    rates: dict[tuple[str, int], list[float]] = {}
    firsts: dict[tuple[str, int], list[float]] = {}
    joined: dict[tuple[str, int], list[float]] = {}
    with tempfile.TemporaryDirectory() as scratch, checkouts(args.baseline, scratch) as sources:
        servers = {}
        try:
            for name, source in sources.items():
                servers[name] = start(source, args, tempfile.mkdtemp(dir=scratch))
            for _, address in servers.values():
                clients_at_once(address, 1, args)  # warm
            for _ in range(args.runs):  # interleaved, so load on the machine falls on both alike
                for level in levels:
                    for name, (_, address) in servers.items():
                        rate, first = clients_at_once(address, level, args)
                        rates.setdefault((name, level), []).append(rate)
                        firsts.setdefault((name, level), []).extend(first)
                for name, (_, address) in servers.items():
                    for others in (0, 3):
                        joined.setdefault((name, others), []).extend(joining(address, others, args))
        finally:
            for server, _ in servers.values():
                server.terminate()
                server.wait()
    print(
        f"Streaming clients at once on {args.model or 'the demo'}, {args.requests} requests each of "
        f"-n {args.new_tokens}, greedy: median (lowest–highest) of {args.runs} runs\n"
    )
    print("| source | clients | aggregate tok/s | ×1 | TTFT ms (median, lowest–highest) |")
    print("|---|---:|---:|---:|---:|")
    for name in servers:
        alone = statistics.median(rates[(name, levels[0])])
        for level in levels:
            ratio = statistics.median(rates[(name, level)]) / alone
            ttft = cell([t * 1000 for t in firsts[(name, level)]], 0)
            print(f"| {name} | {level} | {cell(rates[(name, level)], 1)} | {ratio:.2f} | {ttft} |")
    print("\nTime to the first token of a request sent alone, and sent while 3 clients stream:\n")
    print("| source | alone (ms) | joining 3 streams (ms) | ratio |")
    print("|---|---:|---:|---:|")
    for name in servers:
        alone, busy = joined[(name, 0)], joined[(name, 3)]
        ratio = statistics.median(busy) / statistics.median(alone)
        alone_ms, busy_ms = cell([t * 1000 for t in alone], 0), cell([t * 1000 for t in busy], 0)
        print(f"| {name} | {alone_ms} | {busy_ms} | {ratio:.2f} |")


if __name__ == "__main__":
    main()
