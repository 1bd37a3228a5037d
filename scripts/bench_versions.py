"""Two checkouts of llmcli side by side, in one session, runs interleaved: `llmcli bench` on a
model (decode tok/s, TTFT) and scripts/bench_serve.py (a warm server against in-process calls,
concurrent clients). Each version runs from its own `src` on PYTHONPATH, so a worktree of an
older commit is the baseline:

  git worktree add /tmp/base <commit>
  python scripts/bench_versions.py --base /tmp/base/src --rounds 3

Prints one table: median and spread (min–max) of each figure per version, and the ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
SOURCES = {"this checkout": str(HERE.parent / "src")}


def run_json(command: list[str], source: str) -> dict:
    env = {**os.environ, "PYTHONPATH": source}
    proc = subprocess.run(command, capture_output=True, env=env, timeout=1800)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed:\n{proc.stderr.decode()}")
    return json.loads(proc.stdout.decode().strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--base", required=True, help="the baseline's src folder")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("-m", "--model", default=None)
    parser.add_argument("--skip-serve", action="store_true")
    args = parser.parse_args()
    sources = {"baseline": str(Path(args.base).resolve()), **SOURCES}
    model = ["-m", args.model] if args.model else []
    bench = [sys.executable, "-m", "llmcli", "bench", *model, "--json", "--no-generate"]
    bench += ["--runs", "5", "-n", "64", "--prompt-lengths", "128"]
    serve = [sys.executable, str(HERE / "bench_serve.py"), *model, "--json", "--calls", "10"]
    serve += ["--local-calls", "3", "--clients", "4", "--requests", "5"]
    figures: dict[str, dict[str, list[float]]] = {name: {} for name in sources}
    for round_ in range(args.rounds):
        for name, source in sources.items():  # interleaved: drift in machine speed hits both
            record = run_json(bench, source)
            found = {"decode tok/s": record["decode_tok_s"], "TTFT ms": 1000 * record["ttft_s"]}
            found["prefill tok/s @128"] = record["prefill_tok_s"]["128"]
            if not args.skip_serve:
                served = run_json(serve, source)
                found |= {
                    "warm call wall s": served["warm_wall_s"],
                    "warm call first byte s": served["warm_first_byte_s"],
                    "in-process call wall s": served["local_wall_s"],
                    "4 clients p50 s": served["concurrent_p50_s"],
                    "4 clients requests/s": served["requests_per_s"],
                }
                # Equal to in-process only in fp32: in bf16 a prompt prefilled after a reused
                # prefix rounds differently (bench_serve.py), so this is a count, not a check.
                found["4 clients: replies equal to in-process"] = int(served["equal_replies"].split("/")[0])
            for key, value in found.items():
                figures[name].setdefault(key, []).append(value)
            print(f"round {round_ + 1}, {name}: {json.dumps(found)}", file=sys.stderr)
    base, new = figures["baseline"], figures["this checkout"]
    print(f"\n| figure (median, min–max of {args.rounds}) | baseline | this checkout | ratio |")
    print("|---|---:|---:|---:|")
    for key in base:
        b, n = statistics.median(base[key]), statistics.median(new[key])
        print(
            f"| {key} | {b:.3f} ({min(base[key]):.3f}–{max(base[key]):.3f}) | "
            f"{n:.3f} ({min(new[key]):.3f}–{max(new[key]):.3f}) | {n / b:.3f} |"
        )


if __name__ == "__main__":
    main()
