"""The prompt cache on disk, measured as a user meets it (issue 47's targets):

1. one-shot: `cat report.txt | llmcli generate "question 1"`, then "question 2" in a new process,
   on a ~4,000-token document with the demo model: the second call's time to first token over
   the first's (target ≤ 0.2×);
2. served: a conversation's first turn on `llmcli serve`, `llmcli stop`, a new server, the next
   turn: the share of its prompt reused (target ≥ 90 %);
3. the size bound: 100 distinct prefixes written with a small --prompt-cache-size: the folder's
   largest size after any write, against the bound.

Each part runs --runs times with the prompt cache emptied first; the table gives the median and
the spread (min–max). Real commands, real processes: the model loads in each, and time to first
token is the one `--json` reports (from the request to its first token: the disk read included).

  python scripts/bench_disk_cache.py                 # the demo model, 3 runs
  python scripts/bench_disk_cache.py --runs 5 -m ./some-model
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

LLMCLI = [sys.executable, "-m", "llmcli"]


def report(lines: int) -> str:
    """A plain report of `lines` numbered lines (about 27 tokens each)."""
    rows = [
        f"Line {n}: region {n % 7} shipped {n * 37 % 1000} units in week {n % 52}, "
        f"margin {n * 13 % 40} percent."
        for n in range(lines)
    ]
    return "\n".join(rows)


def generate(model: list[str], env: dict[str, str], question: str, document: str) -> dict[str, Any]:
    proc = subprocess.run(
        [*LLMCLI, "generate", *model, "--json", "-t", "0", "-n", "8", question],
        input=document.encode(),
        capture_output=True,
        env=env,
        check=False,
    )
    if proc.returncode != 0:
        raise SystemExit(f"generate failed: {proc.stderr.decode()}")
    return json.loads(proc.stdout)


def one_shot(model: list[str], env: dict[str, str], prompts: Path, document: str) -> dict[str, float]:
    shutil.rmtree(prompts, ignore_errors=True)
    first = generate(model, env, "Which region shipped the most units?", document)
    second = generate(model, env, "What was the margin in week 3?", document)
    assert second["cached_from"] == "disk", second
    return {
        "prompt": second["prompt_tokens"],
        "cached": second["cached_tokens"],
        "first": first["ttft_s"],
        "second": second["ttft_s"],
        "ratio": second["ttft_s"] / first["ttft_s"],
    }


def start_server(model: list[str], env: dict[str, str]) -> tuple[subprocess.Popen[bytes], str]:
    process = subprocess.Popen(
        [*LLMCLI, "serve", *model, "--port", "0"], stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, env=env
    )
    assert process.stderr is not None
    line = process.stderr.readline().decode()
    while line and "Serving" not in line:
        line = process.stderr.readline().decode()
    if "Serving" not in line:
        raise SystemExit("the server did not start")
    return process, line.split(" at ", 1)[1].split("/v1", 1)[0]


def ask(url: str, messages: list[dict[str, str]]) -> dict[str, Any]:
    body = json.dumps({"model": "demo", "messages": messages, "max_tokens": 16, "temperature": 0}).encode()
    request = urllib.request.Request(f"{url}/v1/chat/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=600) as response:
        return json.loads(response.read())


def served(model: list[str], env: dict[str, str], prompts: Path, document: str) -> dict[str, float]:
    shutil.rmtree(prompts, ignore_errors=True)
    messages = [
        {"role": "system", "content": "Answer questions about this report briefly.\n\n" + document},
        {"role": "user", "content": "Which region shipped the most units?"},
    ]
    process, url = start_server(model, env)
    first = ask(url, messages)
    subprocess.run([*LLMCLI, "stop"], env=env, check=True, capture_output=True)
    process.wait(timeout=600)
    reply = first["choices"][0]["message"]["content"]
    messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": "And the least?"}]
    process, url = start_server(model, env)
    second = ask(url, messages)
    subprocess.run([*LLMCLI, "stop"], env=env, check=True, capture_output=True)
    process.wait(timeout=600)
    usage = second["usage"]
    cached = usage["prompt_tokens_details"]["cached_tokens"]
    return {
        "prompt": usage["prompt_tokens"],
        "cached": cached,
        "share": cached / usage["prompt_tokens"],
        "ttft": second["timings"]["ttft_s"],
        "from_disk": second["timings"].get("cached_from") == "disk",
    }


def size_bound(model_spec: str | None, prompts: Path, bound: int, count: int) -> dict[str, float]:
    """`count` distinct prefixes through one engine with a tier bounded at `bound` bytes."""
    from llmcli.config.settings import LoadSettings, SamplingParams
    from llmcli.engine.loop import Engine
    from llmcli.engine.native.saved_tensors import disk_tier_for
    from llmcli.frontends.loading import load_with_feedback

    shutil.rmtree(prompts, ignore_errors=True)
    loaded = load_with_feedback(model_spec, LoadSettings(), lean=True)
    engine = Engine.for_loaded(loaded)
    facts = {"model": loaded.fingerprint, "dtype": loaded.dtype_name, "quant": loaded.quant}
    tier = disk_tier_for(engine.backend, facts, bound, prompts, print)
    assert tier is not None
    engine.prefixes.disk = tier
    tokenizer = loaded.tokenizer
    largest, files = 0, 0
    for n in range(count):
        text = f"Prefix {n}. " + report(12 + n % 3)[n:]  # about 330 tokens: past MIN_DISK_TOKENS
        ids = tokenizer(text)["input_ids"]
        engine.complete(ids, SamplingParams(temperature=0.0, max_new_tokens=1), tokenizer)
        tier.flush()
        held = list(prompts.glob("*.safetensors"))
        largest = max(largest, sum(path.stat().st_size for path in held))
        files = len(held)
    return {"bound": bound, "largest": largest, "files": files, "writes": count}


def spread(values: list[float], fmt: str) -> str:
    return f"{format(statistics.median(values), fmt)} ({format(min(values), fmt)}–{format(max(values), fmt)})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-m", "--model", default=None, help="Default: the demo model.")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--lines", type=int, default=150, help="The document's lines (~27 tokens each).")
    parser.add_argument("--prefixes", type=int, default=100)
    args = parser.parse_args()
    model = ["-m", args.model] if args.model else []
    home = Path(tempfile.mkdtemp(prefix="llmcli-bench-disk-"))
    env = {
        **os.environ,
        "XDG_RUNTIME_DIR": str(home / "run"),
        "LLMCLI_CACHE_DIR": str(home / "llmcli"),  # the prompts folder of its own, emptied per run
        "LLMCLI_PROMPT_CACHE_SIZE": "4GiB",
    }
    os.environ.update({key: env[key] for key in ("LLMCLI_CACHE_DIR", "XDG_RUNTIME_DIR")})
    (home / "run").mkdir(mode=0o700)
    prompts = home / "llmcli" / "prompts"
    # The demo's GGUF is read in place from files llmcli writes once into its cache: once here.
    generate(model, {**env, "LLMCLI_PROMPT_CACHE_SIZE": "0"}, "Hi", "Hello.")
    document = report(args.lines)
    started = time.perf_counter()
    shots = [one_shot(model, env, prompts, document) for _ in range(args.runs)]
    serves = [served(model, env, prompts, document) for _ in range(args.runs)]
    bound = size_bound(args.model, prompts, 200 * 1024 * 1024, args.prefixes)
    print(f"model: {args.model or 'the demo'} · {args.runs} runs · {time.perf_counter() - started:.0f} s\n")
    mib = 1024 * 1024
    held = "within" if bound["largest"] <= bound["bound"] else "PAST"
    rows = [
        (
            "one-shot: document + question, prompt tokens",
            spread([s["prompt"] for s in shots], ".0f"),
            "~4,000",
        ),
        ("one-shot: 1st call, time to first token (s)", spread([s["first"] for s in shots], ".2f"), ""),
        (
            "one-shot: 2nd call (a new process), time to first token (s)",
            spread([s["second"] for s in shots], ".2f"),
            "",
        ),
        ("one-shot: 2nd / 1st", spread([s["ratio"] for s in shots], ".3f"), "≤ 0.2"),
        ("one-shot: 2nd call's tokens from disk", spread([s["cached"] for s in shots], ".0f"), ""),
        (
            "served, stopped, a new server: next turn's prompt tokens",
            spread([s["prompt"] for s in serves], ".0f"),
            "",
        ),
        (
            "served: share of them reused from disk (%)",
            spread([100 * s["share"] for s in serves], ".1f"),
            "≥ 90",
        ),
        ("served: next turn's time to first token (s)", spread([s["ttft"] for s in serves], ".2f"), ""),
        (
            f"size bound: {bound['writes']} distinct prefixes, bound {bound['bound'] / mib:.0f} MiB",
            f"largest folder {bound['largest']:,} bytes ({held} {bound['bound']:,}), "
            f"{bound['files']} files at the end",
            "≤ bound",
        ),
    ]
    print("| measure | median (min–max) | target |")
    print("|---|---|---|")
    for row in rows:
        print("| " + " | ".join(row) + " |")
    shutil.rmtree(home, ignore_errors=True)


if __name__ == "__main__":
    main()
