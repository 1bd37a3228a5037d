"""A CPU decode step of a GGUF file under each way llmcli can run it, side by side: torch's path
(LLMCLI_CPU_KERNELS=off), the compiled kernels' products with torch's small calls between them
(LLMCLI_CPU_FUSED=0), and the compiled blocks (the default) — and, to show why the default gives
torch one thread, the kernels and torch both on every thread. Each configuration runs in a
process of its own, interleaved round by round; each cell is the median step over the rounds'
medians (min–max of those), in ms, after a 128-token prompt.

  python scripts/bench_cpu_step.py FILE.gguf [--rounds 3] [--steps 60] [--threads 2]

Compare on a quiet machine only (1-minute load < 1.5): the load is printed with the table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

# name: (environment, whether torch keeps every thread too)
CONFIGS = {
    "torch path (kernels off)": ({"LLMCLI_CPU_KERNELS": "off"}, False),
    "kernels' products, torch's small calls": ({"LLMCLI_CPU_FUSED": "0"}, False),
    "compiled blocks (default)": ({}, False),
    "compiled blocks, torch on every thread too": ({}, True),
}
ONE_RUN = """
import json, statistics, sys, time, torch
from llmcli.config.settings import LoadSettings
from llmcli.engine.loop import Engine
from llmcli.models.load import load_model
from llmcli.models.resolve import resolve_model
path, threads, steps, torch_too = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "1"
loaded = load_model(resolve_model(path), LoadSettings(device="cpu", threads=threads), lean=True)
if torch_too:
    torch.set_num_threads(threads)
backend = Engine.for_loaded(loaded).backend
token = torch.tensor([5])
with torch.inference_mode():
    backend.prefill(list(range(10, 138)))
    for _ in range(5):
        backend.decode(token)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        backend.decode(token)
        times.append(time.perf_counter() - start)
ms = statistics.median(times) * 1e3
print(json.dumps({"ms": ms, "quant": loaded.quant, "torch": torch.get_num_threads()}))
"""


def one_run(path: str, config: str, threads: int, steps: int) -> dict[str, object]:
    environment, torch_too = CONFIGS[config]
    result = subprocess.run(
        [sys.executable, "-c", ONE_RUN, path, str(threads), str(steps), "1" if torch_too else "0"],
        env={**os.environ, "LLMCLI_PROMPT_CACHE_SIZE": "0", **environment},
        capture_output=True,
        text=True,
        check=False,
    )
    if result.returncode != 0:
        raise SystemExit(f"{config}: {result.stderr.strip().splitlines()[-1:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("file")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    found: dict[str, list[float]] = {name: [] for name in CONFIGS}
    labels: dict[str, str] = {}
    loads = []
    for round_index in range(args.rounds):
        order = list(CONFIGS) if round_index % 2 == 0 else list(reversed(CONFIGS))
        for name in order:
            loads.append(os.getloadavg()[0])
            run = one_run(args.file, name, args.threads, args.steps)
            found[name].append(float(run["ms"]))
            labels[name] = f"{run['quant']}, torch threads {run['torch']}"
    baseline = statistics.median(found["torch path (kernels off)"])
    print(f"{os.path.basename(args.file)} · {args.threads} threads · decode step after 128 tokens")
    print("| configuration | held as | step ms (min–max) | tok/s | × torch path |")
    print("|---|---|---:|---:|---:|")
    for name, values in found.items():
        median = statistics.median(values)
        print(
            f"| {name} | {labels[name]} | {median:.2f} ({min(values):.2f}–{max(values):.2f}) "
            f"| {1e3 / median:.0f} | {baseline / median:.2f} |"
        )
    print(f"1-minute load at the runs: {min(loads):.2f}–{max(loads):.2f}")


if __name__ == "__main__":
    main()
