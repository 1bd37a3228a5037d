"""A one-shot `llmcli generate` as a shell script meets it: wall time, the first byte on stdout,
peak RSS, and the time from the last byte to the process's exit — for this checkout and, beside
it in the same run, an earlier commit (--baseline REV, checked out into a temporary worktree).

Runs are interleaved (this, the baseline, this, …), so load on the machine falls on both alike;
each figure is the median of --runs with the lowest and highest beside it. The model is the demo
unless -m names another; the page cache is warm after the first run of each, and each checkout
has a cache folder of its own, filled by that first run.

    python scripts/bench_oneshot.py [--runs 5] [--baseline REV] [-m MODEL] [-n 32]
                                    [--llama-cpp PYTHON]
    python scripts/bench_oneshot.py --keep-alive 5m [--runs 5]

--llama-cpp PYTHON: a column for llama.cpp too, the same one-shot call made by a Python that has
llama-cpp-python installed (a venv of its own: it builds llama.cpp from source, which llmcli never
needs): the GGUF file loaded, the prompt through the file's chat template, greedy, streamed to
stdout token by token, the process timed from its start as llmcli's is.

--keep-alive: the calls after one that left a background server of the model (`generate
--keep-alive`), in runtime and state folders of the benchmark's own; the server is stopped at
the end.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from checkouts import checkouts
from llmcli.models.resolve import demo_gguf_path

ROOT = Path(__file__).resolve().parents[1]


# llama.cpp's one-shot, as `llama-cli -no-cnv` or a script would make it through llama-cpp-python.
LLAMA_CPP_ONE_SHOT = """
import sys
from llama_cpp import Llama
path, tokens, prompt = sys.argv[1], int(sys.argv[2]), sys.argv[3]
model = Llama(model_path=path, n_ctx=2048, verbose=False)
chunks = model.create_chat_completion(
    [{"role": "user", "content": prompt}], max_tokens=tokens, temperature=0.0, top_k=1, stream=True
)
for chunk in chunks:
    sys.stdout.write(chunk["choices"][0]["delta"].get("content") or "")
    sys.stdout.flush()
"""


def one_run(
    source: Path, args: argparse.Namespace, *extra: str, cache: str | None = None
) -> dict[str, float]:
    """`cache`: a cache folder of this source's own (an older llmcli may not read a newer's)."""
    command = [sys.executable, "-m", "llmcli", "generate", "-t", "0", "-n", str(args.new_tokens), *extra]
    command += ["-m", args.model] if args.model else []
    env = {**os.environ, "PYTHONPATH": str(source / "src")} | ({"XDG_CACHE_HOME": cache} if cache else {})
    return timed([*command, args.prompt], env, str(source))


def llama_cpp_run(args: argparse.Namespace) -> dict[str, float]:
    model = args.model or str(demo_gguf_path())
    command = [args.llama_cpp, "-c", LLAMA_CPP_ONE_SHOT, model, str(args.new_tokens), args.prompt]
    return timed(command, dict(os.environ), "llama.cpp")


def timed(command: list[str], env: dict[str, str], name: str) -> dict[str, float]:
    """Wall time, first and last byte on stdout, peak RSS and exit of one call of `command`."""
    start = time.perf_counter()
    proc = subprocess.Popen(
        command,
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
        raise SystemExit(f"{name}: the one-shot call failed (status {status})")
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
    # Long enough that every column generates all its tokens (a reply that ends sooner is faster).
    parser.add_argument("--prompt", default="Write a long story about the sea.")
    parser.add_argument("--keep-alive", help="time the calls after one that kept the model loaded")
    parser.add_argument("--llama-cpp", metavar="PYTHON", help="a Python with llama-cpp-python")
    args = parser.parse_args()
    if args.keep_alive:
        if args.baseline or args.llama_cpp:
            raise SystemExit("--keep-alive measures this checkout only")
        kept_alive(args)
        return
    with tempfile.TemporaryDirectory() as scratch, checkouts(args.baseline, scratch) as sources:
        calls = {
            name: functools.partial(one_run, source, args, cache=f"{scratch}/cache-{index}")
            for index, (name, source) in enumerate(sources.items())
        }
        if args.llama_cpp:
            calls["llama.cpp (llama-cpp-python)"] = functools.partial(llama_cpp_run, args)
        for call in calls.values():
            call()  # the page cache, bytecode and any conversion, before measuring
        results: dict[str, list[dict[str, float]]] = {name: [] for name in calls}
        for _ in range(args.runs):
            for name, call in calls.items():
                results[name].append(call())
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
