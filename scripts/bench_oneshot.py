"""A one-shot `llmcli generate` as a shell script meets it: wall time, the first byte on stdout,
peak RSS, and the time from the last byte to the process's exit — for this checkout and, beside
it in the same run, an earlier commit (--baseline REV, checked out into a temporary worktree).

Runs are interleaved (this, the baseline, this, …), so load on the machine falls on both alike;
each figure is the median of --runs with the lowest and highest beside it. The model is the demo
unless -m names another; the page cache is warm after the first run of each.

    python scripts/bench_oneshot.py [--runs 5] [--baseline REV] [-m MODEL] [-n 32]
    python scripts/bench_oneshot.py --keep-alive 5m [--runs 5]

--keep-alive: the calls after one that left a background server of the model (`generate
--keep-alive`), in runtime and state folders of the benchmark's own; the server is stopped at
the end.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from checkouts import checkouts

ROOT = Path(__file__).resolve().parents[1]


def one_run(source: Path, args: argparse.Namespace, *extra: str) -> dict[str, float]:
    command = [sys.executable, "-m", "llmcli", "generate", "-t", "0", "-n", str(args.new_tokens), *extra]
    command += ["-m", args.model] if args.model else []
    env = {**os.environ, "PYTHONPATH": str(source / "src")}
    start = time.perf_counter()
    proc = subprocess.Popen(
        [*command, args.prompt],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        stdin=subprocess.DEVNULL,
        env=env,
    )
    assert proc.stdout is not None
    first = last = None
    while os.read(proc.stdout.fileno(), 65536):
        last = time.perf_counter()
        first = first or last
    _, status, usage = os.wait4(proc.pid, 0)
    end = time.perf_counter()
    if status != 0 or first is None or last is None:
        raise SystemExit(f"{source}: generate failed (status {status})")
    return {
        "wall_s": end - start,
        "first_byte_s": first - start,
        "peak_rss_mib": usage.ru_maxrss / 1024,  # kilobytes on Linux
        "exit_s": end - last,
    }


def cell(values: list[float], digits: int) -> str:
    return f"{statistics.median(values):.{digits}f} ({min(values):.{digits}f}–{max(values):.{digits}f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--baseline", help="a git revision to measure beside this checkout")
    parser.add_argument("-m", "--model", help="the model (default: the demo)")
    parser.add_argument("-n", "--new-tokens", type=int, default=32)
    parser.add_argument("--prompt", default="Write one sentence about the sea.")
    parser.add_argument("--keep-alive", help="time the calls after one that kept the model loaded")
    args = parser.parse_args()
    if args.keep_alive:
        if args.baseline:
            raise SystemExit("--keep-alive measures this checkout only")
        kept_alive(args)
        return
    with tempfile.TemporaryDirectory() as scratch, checkouts(args.baseline, scratch) as sources:
        for source in sources.values():
            one_run(source, args)  # the page cache and any conversion, before measuring
        results: dict[str, list[dict[str, float]]] = {name: [] for name in sources}
        for _ in range(args.runs):
            for name, source in sources.items():
                results[name].append(one_run(source, args))
    report(args, results)


def kept_alive(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory() as scratch:
        places = {"XDG_RUNTIME_DIR": f"{scratch}/run", "XDG_STATE_HOME": f"{scratch}/state"}
        os.makedirs(places["XDG_RUNTIME_DIR"])
        os.environ.update(places)
        llmcli = [sys.executable, "-m", "llmcli"]
        try:
            one_run(ROOT, args, "--keep-alive", args.keep_alive)
            deadline = time.monotonic() + 600
            while not json.loads(
                subprocess.run([*llmcli, "ps", "--json"], capture_output=True).stdout or "[]"
            ):
                if time.monotonic() > deadline:
                    raise SystemExit("the background server did not come up in 10 minutes")
                time.sleep(0.2)
            one_run(ROOT, args)  # the server's first request
            results = {
                f"after --keep-alive {args.keep_alive}": [one_run(ROOT, args) for _ in range(args.runs)]
            }
        finally:
            subprocess.run([*llmcli, "stop"], capture_output=True, check=False)
    report(args, results)


def listed(llmcli: list[str]) -> bool:
    """Whether `llmcli ps` lists a server (the background one has loaded)."""
    return bool(json.loads(subprocess.run([*llmcli, "ps", "--json"], capture_output=True).stdout or "[]"))


def report(args: argparse.Namespace, results: dict[str, list[dict[str, float]]]) -> None:
    print(
        f"`llmcli generate -t 0 -n {args.new_tokens}` on {args.model or 'the demo'}: "
        f"median (lowest–highest) of {args.runs} runs\n"
    )
    names = list(results)
    print("| measure | " + " | ".join(names) + " |")
    print("|---|" + "---:|" * len(names))
    for key, label, digits in (
        ("wall_s", "wall time (s)", 2),
        ("first_byte_s", "first byte on stdout (s)", 2),
        ("peak_rss_mib", "peak RSS (MiB)", 0),
        ("exit_s", "last byte → exit (s)", 3),
    ):
        print(
            f"| {label} | "
            + " | ".join(cell([run[key] for run in results[name]], digits) for name in names)
            + " |"
        )


if __name__ == "__main__":
    main()
