"""What Qwen3.5's state checkpoints (engine/native/recurrent_cache.py) save and cost, on random
weights from a config (default: a Qwen3.5-0.8B-like layer shape at 8 layers, a CPU run of
minutes).

1. An agent's turns: a long system prompt, then turns that each add a reply and a message. Every
   turn's prompt rewrites the end of the last reply (as a template dropping its thinking does),
   and every other turn is a retry of the one before. Per turn, time to first token and tokens
   prefilled, for:
   - native: the native engine, resuming from its checkpoints;
   - transformers: transformers' engine, whose cache starts empty wherever a prompt does not
     extend it (a recurrent state cannot be cropped);
   - no reuse: every prompt prefilled whole (what llama.cpp did before its state checkpoints).
2. The checkpoint interval: a 2048-token prefill with a checkpoint every 256, 512 or 1024 tokens
   or none, and the memory those checkpoints hold.
Figures: median (lowest–highest) of --runs runs.

    python scripts/bench_recurrent_cache.py [--config configs/qwen3.5-hybrid-cpu-bench.json] [--runs 3]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from llmcli.config.settings import LoadSettings
from llmcli.engine.loop import Engine
from llmcli.engine.native.recurrent_cache import RecurrentCache
from llmcli.models.load import load_random

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "qwen3.5-hybrid-cpu-bench.json"
SYSTEM, MESSAGE, REPLY, REWRITTEN = 1500, 40, 32, 8  # tokens
TURNS = 6


def ids(count: int, seed: int) -> list[int]:
    return torch.randint(0, 30000, (count,), generator=torch.Generator().manual_seed(seed)).tolist()


def figure(values: list[float], scale: float = 1.0, digits: int = 2) -> str:
    low, middle, high = (
        f"{value * scale:.{digits}f}" for value in (min(values), statistics.median(values), max(values))
    )
    return f"{middle} ({low}–{high})"


@torch.inference_mode()
def agent_turns(engine: Engine, reuse: bool) -> list[tuple[float, int]]:
    """(seconds to the first token, tokens prefilled) per turn."""
    engine.reset()
    history, turns = ids(SYSTEM, seed=1), []
    prompt: list[int] = []
    for number in range(TURNS):
        retry = number % 2 == 1
        if not retry:  # the last reply's end rewritten, then a new message
            prompt = history[: len(history) - REWRITTEN] + ids(REWRITTEN + MESSAGE, seed=10 + number)
        if not reuse:
            engine.reset()
        start = time.perf_counter()
        held = engine.reuse_prefix(prompt)
        logits = engine.prefill(prompt[held:])
        turns.append((time.perf_counter() - start, len(prompt) - held))
        reply = []
        for _ in range(REPLY):
            reply.append(int(logits.argmax()))
            logits = engine.decode_step(reply[-1])
        history = prompt + reply
    return turns


@torch.inference_mode()
def prefill_with_interval(engine: Engine, interval: int | None, length: int) -> tuple[float, int, int]:
    """Seconds for a `length`-token prefill, checkpoints kept and their bytes."""
    cache = engine.backend.cache
    assert isinstance(cache, RecurrentCache)
    cache.interval = interval or 1 << 40
    engine.reset()
    start = time.perf_counter()
    engine.prefill(ids(length, seed=2))
    seconds = time.perf_counter() - start
    return seconds, len(cache.points), len(cache.points) * cache.state_bytes


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--config", default=str(CONFIG))
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()

    settings = LoadSettings(device="cpu", dtype="fp32", threads=args.threads, engine="auto")
    loaded = load_random(args.config, settings)
    engines = {
        "native": (Engine.for_loaded(loaded), True),
        "transformers": (Engine.for_loaded(_as(loaded, "transformers")), True),
        "no reuse (native)": (Engine.for_loaded(loaded), False),
    }
    assert engines["native"][0].name == "native" and engines["transformers"][0].name == "transformers"
    results: dict[str, list[list[tuple[float, int]]]] = {name: [] for name in engines}
    for _ in range(args.runs):  # interleaved, so a slower minute costs every column alike
        for name, (engine, reuse) in engines.items():
            results[name].append(agent_turns(engine, reuse))
    print(f"{loaded.name}, fp32, {args.runs} runs; system prompt {SYSTEM} tokens, messages {MESSAGE},")
    print(
        f"replies {REPLY}, each turn rewriting the last {REWRITTEN} tokens of the reply; odd turns retry.\n"
    )
    print("| turn | " + " | ".join(f"{name}: TTFT ms (prefilled)" for name in engines) + " |")
    print("|---|" + "---:|" * len(engines))
    for number in range(TURNS):
        cells = []
        for name in engines:
            seconds = [run[number][0] for run in results[name]]
            cells.append(f"{figure(seconds, 1000, 0)} ({results[name][0][number][1]})")
        label = f"{number + 1}{' (retry)' if number % 2 else ''}"
        print(f"| {label} | " + " | ".join(cells) + " |")

    engine = engines["native"][0]
    print("\n| checkpoint every | 2048-token prefill, s | checkpoints kept | their memory |")
    print("|---|---:|---:|---:|")
    for interval in (256, 512, 1024, None):
        runs = [prefill_with_interval(engine, interval, 2048) for _ in range(args.runs)]
        seconds = [run[0] for run in runs]
        _, kept, held = runs[0]
        print(f"| {interval or 'never'} | {figure(seconds)} | {kept} | {held / 2**20:.1f} MiB |")


def _as(loaded, engine: str):
    import dataclasses

    return dataclasses.replace(loaded, engine=engine)


if __name__ == "__main__":
    main()
