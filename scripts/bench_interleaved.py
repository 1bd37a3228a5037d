"""Chats whose turns interleave on one `llmcli serve`: how much of each conversation a turn finds
cached, and its time to the first token — for this checkout and, beside it in the same run, an
earlier commit (--baseline REV, checked out into a temporary worktree).

--chats conversations, each a shared system prompt and a long first message, take --rounds turns
in turn (greedy, -n tokens each, non-streaming), on a server of each source started fresh. From
the second round on, each turn reports cached_tokens as a share of its conversation so far and
the server's own TTFT; a figure is the median (lowest–highest) over those turns.

    python scripts/bench_interleaved.py [--baseline REV] [-m MODEL] [--chats 3] [--rounds 4]
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from checkouts import checkouts

SYSTEM = "You are a patient guide. " + " ".join(f"Rule {i}: answer plainly and briefly." for i in range(20))
TOPICS = ["harbours and boats", "mountains and snow", "gardens and rain", "deserts and wind", "rivers"]


def start(source: Path, args: argparse.Namespace, runtime: str) -> tuple[subprocess.Popen[bytes], str]:
    command = [sys.executable, "-m", "llmcli", "serve", "--port", "0", "--quiet"]
    command += ["-m", args.model] if args.model else []
    env = {**os.environ, "PYTHONPATH": str(source / "src"), "XDG_RUNTIME_DIR": runtime}
    server = subprocess.Popen(command, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, env=env)
    assert server.stderr is not None
    for raw in server.stderr:
        line = raw.decode()
        if "Serving" in line:
            return server, line.split(" at http://", 1)[1].split("/v1", 1)[0]
    raise SystemExit(f"{source}: the server did not start")


def ask(address: str, messages: list[dict[str, str]], new_tokens: int) -> dict:
    host, port = address.rsplit(":", 1)
    connection = http.client.HTTPConnection(host, int(port), timeout=600)
    body = {"model": "m", "messages": messages, "max_tokens": new_tokens, "temperature": 0}
    connection.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
    reply = json.loads(connection.getresponse().read())
    connection.close()
    if "error" in reply:
        raise SystemExit(f"the server refused a turn: {reply['error']}")
    return reply


def interleave(address: str, args: argparse.Namespace) -> tuple[list[float], list[float]]:
    chats = [
        [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": " ".join(f"Tell me about {topic}, part {i}." for i in range(25))},
        ]
        for topic in TOPICS[: args.chats]
    ]
    so_far = [0] * args.chats
    shares, ttfts = [], []
    for round_number in range(args.rounds):
        for n, messages in enumerate(chats):
            reply = ask(address, messages, args.new_tokens)
            usage = reply["usage"]
            if round_number:
                shares.append(usage["prompt_tokens_details"]["cached_tokens"] / so_far[n])
                ttfts.append(reply["timings"]["ttft_s"])
            so_far[n] = usage["prompt_tokens"] + usage["completion_tokens"]
            messages += [
                {"role": "assistant", "content": reply["choices"][0]["message"]["content"]},
                {"role": "user", "content": f"And after that, in round {round_number}?"},
            ]
    return shares, ttfts


def cell(values: list[float], digits: int, scale: float = 1.0) -> str:
    values = [v * scale for v in values]
    return f"{statistics.median(values):.{digits}f} ({min(values):.{digits}f}–{max(values):.{digits}f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", help="a git revision to measure beside this checkout")
    parser.add_argument("-m", "--model", help="the model (default: the demo)")
    parser.add_argument("--chats", type=int, default=3, choices=range(1, len(TOPICS) + 1))
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("-n", "--new-tokens", type=int, default=32)
    args = parser.parse_args()
    results: dict[str, tuple[list[float], list[float]]] = {}
    with tempfile.TemporaryDirectory() as scratch, checkouts(args.baseline, scratch) as sources:
        for name, source in sources.items():
            server, address = start(source, args, tempfile.mkdtemp(dir=scratch))
            try:
                results[name] = interleave(address, args)
            finally:
                server.terminate()
                server.wait()
    print(
        f"{args.chats} chats × {args.rounds} rounds, turns interleaved, -n {args.new_tokens}, on "
        f"{args.model or 'the demo'}: median (lowest–highest) over the turns from round 2\n"
    )
    names = list(results)
    print("| measure | " + " | ".join(names) + " |")
    print("|---|" + "---:|" * len(names))
    for label, index, scale in (("cached, % of the conversation so far", 0, 100), ("TTFT (ms)", 1, 1000)):
        print(f"| {label} | " + " | ".join(cell(results[n][index], 0, scale) for n in names) + " |")


if __name__ == "__main__":
    main()
