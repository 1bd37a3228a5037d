"""What a streamed piece costs the server to encode in each protocol, for this checkout and,
beside it in the same run, an earlier commit (--baseline REV, checked out into a temporary
worktree): the server-side work per token of a streamed reply, apart from the model.

  python scripts/bench_encoders.py --baseline 9b86ff4

Each source runs in a process of its own (its `src` first on the path) and streams --pieces text
pieces of one choice through each protocol's encoding, --runs times; reported: microseconds per
piece, median (min–max). Since issue 43 an encoder turns the server's own events into its
protocol's stream (server/events.py); before it, Anthropic, Responses and Ollama read OpenAI's
SSE stream back (a json.loads per piece), so their figure there includes OpenAI's encoding, as
their stream's cost did. A reply's model time is the same in both: bench_protocols.py --stream
measures whole requests.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

from checkouts import checkouts

PROTOCOLS = ("OpenAI chat", "Anthropic", "Responses", "Ollama")


def timed(encode: Callable[[], None], pieces: int, runs: int) -> list[float]:
    """µs per piece of each run."""
    spent = []
    for _ in range(runs):
        start = time.perf_counter()
        encode()
        spent.append((time.perf_counter() - start) / pieces * 1e6)
    return spent


def encoders_now(pieces: int) -> dict[str, Callable[[], None]]:
    """Each protocol's encoder (server/events.py), fed text pieces."""
    from llmcli.engine.reasoning import CONTENT
    from llmcli.server.anthropic import AnthropicEncoder
    from llmcli.server.events import Piece
    from llmcli.server.ollama import OllamaEncoder
    from llmcli.server.openai import OpenAIEncoder
    from llmcli.server.responses import ResponsesEncoder

    served = SimpleNamespace(model_id="m", loaded=SimpleNamespace(tokenizer=None))
    job = SimpleNamespace(chat=True, ids=[1] * 30)
    makers = {
        "OpenAI chat": lambda: OpenAIEncoder(served, [job], chat=True),
        "Anthropic": lambda: AnthropicEncoder("m", [job]),
        "Responses": lambda: ResponsesEncoder({"id": "resp_x"}, [], None),
        "Ollama": lambda: OllamaEncoder("m", True, [job]),
    }

    def stream(make: Callable[[], object]) -> None:
        encoder = make()
        for _ in range(pieces):
            encoder.piece(Piece(0, CONTENT, "tok"))  # type: ignore[attr-defined]

    return {name: functools.partial(stream, make) for name, make in makers.items()}


def encoders_before(pieces: int) -> dict[str, Callable[[], None]]:
    """Before issue 43: OpenAI's chunks as SSE, which the other protocols' adapters read back."""
    from llmcli.engine.reasoning import CONTENT
    from llmcli.server import anthropic, app, ollama, responses

    served = SimpleNamespace(model_id="m", loaded=SimpleNamespace(tokenizer=None))
    job = SimpleNamespace(chat=True, ids=[1] * 30)
    chunk = functools.partial(app._chunk, "m", "chatcmpl-x", 0, True, index=0)

    def openai_sse():
        for _ in range(pieces):
            yield app._sse(app._piece_chunk(served, job, chunk, CONTENT, "tok"))

    async def openai_stream():
        for text in openai_sse():
            yield text

    async def drain(stream) -> None:
        async for _ in stream:
            pass

    def openai() -> None:
        for _ in openai_sse():
            pass

    return {
        "OpenAI chat": openai,
        "Anthropic": lambda: asyncio.run(drain(anthropic._events(openai_stream(), "m", 30))),
        "Responses": lambda: asyncio.run(drain(responses._events(openai_stream(), {"id": "r"}, [], None))),
        "Ollama": lambda: asyncio.run(drain(ollama._lines(openai_stream(), "m", True, 0.0))),
    }


def measure(pieces: int, runs: int) -> dict[str, list[float]]:
    """In this process: each protocol's µs per piece, by whichever encoding this source has."""
    try:
        import llmcli.server.events  # noqa: F401
    except ImportError:
        encoders = encoders_before(pieces)
    else:
        encoders = encoders_now(pieces)
    return {name: timed(encode, pieces, runs) for name, encode in encoders.items()}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--baseline", help="a git revision to measure beside this checkout")
    parser.add_argument("--pieces", type=int, default=20000)
    parser.add_argument("--runs", type=int, default=9)
    parser.add_argument("--inner", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.inner:  # one source, its figures as JSON for the parent
        print(json.dumps(measure(args.pieces, args.runs)))
        return
    figures: dict[str, dict[str, list[float]]] = {}
    with tempfile.TemporaryDirectory() as scratch, checkouts(args.baseline, scratch) as sources:
        for name, source in sources.items():
            env = {**os.environ, "PYTHONPATH": f"{source / 'src'}{os.pathsep}{Path(__file__).parent}"}
            command = [sys.executable, __file__, "--inner", "--pieces", str(args.pieces)]
            command += ["--runs", str(args.runs)]
            done = subprocess.run(command, env=env, capture_output=True, text=True, check=True)
            figures[name] = json.loads(done.stdout)
    names = list(figures)
    print(f"µs per streamed text piece, median (min–max) of {args.runs} runs of {args.pieces} pieces")
    print()
    print("| protocol | " + " | ".join(names) + (" | ratio |" if len(names) > 1 else ""))
    print("|---|" + "---:|" * len(names) + ("---:|" if len(names) > 1 else ""))
    for protocol in PROTOCOLS:
        cells = [
            f"{statistics.median(f[protocol]):.2f} ({min(f[protocol]):.2f}–{max(f[protocol]):.2f})"
            for f in figures.values()
        ]
        ratio = ""
        if len(names) > 1:
            now, before = (statistics.median(figures[n][protocol]) for n in names[:2])
            ratio = f" {now / before:.2f} |"
        print(f"| {protocol} | " + " | ".join(cells) + " |" + ratio)


if __name__ == "__main__":
    main()
