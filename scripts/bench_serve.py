"""One-shot calls with and without a warm `llmcli serve`, and the server under concurrent clients.

Starts `llmcli serve` on a free loopback port (its own runtime dir, so it is found by itself),
then, as a shell script would:
  * `llmcli generate -n N -t 0 PROMPT` run --calls times in a row through the server: wall time
    per call (process start to exit) and time to the first byte on stdout;
  * the same command with --no-server, --local-calls times (each imports torch and loads);
  * --clients threads × --requests streaming requests each, all at once, greedy: every reply
    must equal the in-process reply to the same prompt; latency p50/p99 per request.

  python scripts/bench_serve.py                    # the demo model
  python scripts/bench_serve.py -m DIR --calls 20 --local-calls 20
  python scripts/bench_serve.py --load "--dtype fp32 --quant none" --requests 5

Greedy replies are compared token for token only in fp32: in bf16 a prompt prefilled after a
reused prefix rounds differently from one prefilled whole, and near-ties late in a reply flip.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time

from llmcli.server.client import Client

PROMPT = "What is the capital of France?"
CLIENT_PROMPTS = [
    "Name a primary colour.",
    "What is 2 + 2?",
    "Say hello in French.",
    "Name a planet.",
    "What is the opposite of hot?",
    "Name a fruit that is yellow.",
    "How many legs does a spider have?",
    "What do bees make?",
]


def timed_call(command: list[str], env: dict[str, str]) -> tuple[float, float, str]:
    """(wall s, first stdout byte s, stdout) of one command."""
    started = time.perf_counter()
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    assert process.stdout is not None
    first = process.stdout.read(1)
    first_at = time.perf_counter() - started
    rest = process.stdout.read()
    error = process.stderr.read() if process.stderr else b""
    process.wait()
    wall = time.perf_counter() - started
    if process.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed: {error.decode()}")
    return wall, first_at, (first + rest).decode()


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("-m", "--model", default=None)
    parser.add_argument("-n", "--new-tokens", type=int, default=32)
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--local-calls", type=int, default=5)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--requests", type=int, default=20)
    parser.add_argument(
        "--load", default="", help='load options for both sides, e.g. "--dtype fp32 --quant none"'
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object, not tables")
    args = parser.parse_args()

    runtime = tempfile.mkdtemp(prefix="llmcli-bench-serve-")
    env = {**os.environ, "XDG_RUNTIME_DIR": runtime}
    llmcli = [sys.executable, "-m", "llmcli"]
    model = (["-m", args.model] if args.model else []) + args.load.split()
    server = subprocess.Popen(
        [*llmcli, "serve", *model, "--port", "0"], stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, env=env
    )
    assert server.stderr is not None
    line = server.stderr.readline().decode()
    if "Serving" not in line:
        raise SystemExit(f"the server did not start: {line}")
    url = line.split(" at ", 1)[1].split("/v1", 1)[0]
    try:
        generate = [*llmcli, "generate", *model, "-t", "0", "-n", str(args.new_tokens), PROMPT]
        warm = [timed_call(generate, env) for _ in range(args.calls)]
        local = [timed_call([*generate[:-1], "--no-server", PROMPT], env) for _ in range(args.local_calls)]
        if {out for *_, out in warm} != {out for *_, out in local}:
            raise SystemExit("the server's reply differs from the in-process one")

        expected = {}
        for prompt in CLIENT_PROMPTS[: args.clients]:
            record = timed_call([*generate[:-1], "--no-server", "--json", prompt], env)[2]
            expected[prompt] = json.loads(record)["text"]
        latencies: list[float] = []
        wrong: list[str] = []
        lock = threading.Lock()

        def client_loop(prompt: str) -> None:
            client = Client(url)
            body = {
                "messages": [{"role": "user", "content": prompt}],
                "temperature": 0,
                "max_tokens": args.new_tokens,
            }
            for _ in range(args.requests):
                started = time.perf_counter()
                text = "".join(
                    (choice.get("delta") or {}).get("content") or ""
                    for event in client.stream("chat/completions", body)
                    for choice in event.get("choices") or ()
                )
                with lock:
                    latencies.append(time.perf_counter() - started)
                    if text != expected[prompt]:
                        wrong.append(prompt)

        threads = [threading.Thread(target=client_loop, args=(p,)) for p in expected]
        started = time.perf_counter()
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        concurrent_s = time.perf_counter() - started
    finally:
        server.terminate()
        server.wait(timeout=30)

    warm_wall = statistics.median(w for w, _, _ in warm)
    local_wall = statistics.median(w for w, _, _ in local)
    total = args.clients * args.requests
    if args.json:
        record = {
            "warm_wall_s": warm_wall,
            "warm_first_byte_s": statistics.median(f for _, f, _ in warm),
            "local_wall_s": local_wall,
            "local_first_byte_s": statistics.median(f for _, f, _ in local),
            "concurrent_p50_s": percentile(latencies, 0.5),
            "concurrent_p99_s": percentile(latencies, 0.99),
            "requests_per_s": total / concurrent_s,
            "equal_replies": f"{total - len(wrong)}/{total}",
        }
        print(json.dumps(record))
        return
    print(f"\n{args.model or 'demo model'} {args.load} · generate -n {args.new_tokens} · greedy · medians\n")
    print("| | wall s / call | first byte s | calls |")
    print("|---|---:|---:|---:|")
    rows = (("through `llmcli serve`", warm, warm_wall), ("in-process (`--no-server`)", local, local_wall))
    for label, calls, wall in rows:
        first_byte = statistics.median(f for _, f, _ in calls)
        print(f"| {label} | {wall:.3f} | {first_byte:.3f} | {len(calls)} |")
    print(
        f"\n{args.calls} sequential calls: {sum(w for w, _, _ in warm):.1f} s through the server vs "
        f"{args.calls * local_wall:.1f} s in-process ({args.calls} × the median) → "
        f"{local_wall / warm_wall:.1f}× faster"
    )
    print(
        f"\n{args.clients} concurrent streaming clients × {args.requests} requests: "
        f"{total - len(wrong)}/{total} replies equal to the in-process reply · "
        f"latency p50 {percentile(latencies, 0.5):.3f} s, "
        f"p99 {percentile(latencies, 0.99):.3f} s · {total / concurrent_s:.1f} requests/s"
    )


if __name__ == "__main__":
    main()
