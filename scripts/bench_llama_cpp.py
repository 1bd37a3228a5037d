"""llmcli beside llama.cpp on the same GGUF files, the same threads, in the same sitting: decode
and prefill tok/s, the weights held against the file, and perplexity — one markdown table.

For each file of the speed set (scripts/speed_set.py: a random Llama at the demo's scale, width
1024, every K-quant real; made once into --dir) and the demo model, interleaved round by round so
that load on the machine falls on every column alike:
  * llama.cpp: `llama-bench -m FILE -p 512 -n 64 -t 2 -r RUNS -o json`;
  * llmcli under each LLMCLI_CPU_KERNELS mode (--modes, default off,auto: torch's path and the
    compiled kernels): `llmcli bench -m FILE --prompt-lengths 512 -n 64 --no-generate --runs RUNS
    --threads 2 --device cpu --json`, whose weight_bytes is the weights held;
  * perplexity on --text (scripts/data/quality.txt) by `llama-perplexity -c CTX` and by llmcli's
    own forward on the same chunks: llama-perplexity's scheme (chunks of CTX tokens, BOS first
    where the tokenizer adds one, the second half of each chunk scored), so the two figures count
    the same tokens.
Each cell is the median of the rounds' medians, with the lowest and highest single figure beside
it; the ratio columns are llmcli's median over llama.cpp's.

Fair figures need a quiet machine: llama.cpp's threads spin at barriers and lose far more than
torch's under oversubscription (../shared/MEASURED.md). Before each run the 1-minute load average
is read (waiting up to --settle seconds for it to fall below --max-load); a figure taken above
it is flagged `*` (left out of the table with --refuse-loaded, kept in the JSON), as is one during
which other processes kept more than --max-others cores busy (all the machine's CPU time less this
script's children's: the load average alone also counts this script's own previous run). Every
figure goes to the JSON file (--out) as it is taken.

  python scripts/bench_llama_cpp.py                                 # the whole set, 3 rounds
  python scripts/bench_llama_cpp.py --types Q4_0,Q8_0 --rounds 1 --runs 2 --no-demo   # minutes
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from speed_set import DEFAULT_DIR, LLAMA_CPP, STEM, TYPES, make_speed_set

QUALITY_TEXT = Path(__file__).parent / "data" / "quality.txt"
LLAMA_CPP_COLUMN = "llama.cpp"
# llmcli's perplexity in a process of its own (LLMCLI_CPU_KERNELS is read there), chunked as
# llama-perplexity chunks: argv = file, text file, context, threads.
LLMCLI_PERPLEXITY = """
import json, math, sys
import torch
from llmcli.config.settings import LoadSettings
from llmcli.engine.loop import Engine
from llmcli.models.load import load_model
from llmcli.models.resolve import resolve_model
path, text, n_ctx, threads = sys.argv[1], open(sys.argv[2]).read(), int(sys.argv[3]), int(sys.argv[4])
loaded = load_model(resolve_model(path), LoadSettings(device="cpu", threads=threads), lean=True)
backend = Engine.for_loaded(loaded).backend
tokenizer = loaded.tokenizer
ids = tokenizer.encode(text)
add_bos = len(ids) > len(tokenizer.encode(text, add_special_tokens=False))
if len(ids) < 2 * n_ctx:  # as llama-perplexity refuses it
    sys.exit(f"{len(ids)} tokens: perplexity in chunks of {n_ctx} needs {2 * n_ctx}")
first, nll, count = n_ctx // 2, 0.0, 0
with torch.inference_mode():
    for start in range(0, len(ids) - n_ctx + 1, n_ctx):
        chunk = ids[start : start + n_ctx]
        if add_bos:
            chunk[0] = tokenizer.bos_token_id
        backend.reset()
        rows = torch.log_softmax(backend.score(chunk).double(), dim=-1)
        targets = torch.tensor(chunk[first + 1 :])
        nll -= float(rows[first:-1].gather(1, targets[:, None]).sum())
        count += len(targets)
print(json.dumps({"ppl": math.exp(nll / count), "chunks": len(ids) // n_ctx, "tokens": len(ids)}))
"""


class Recorder:
    """Every figure, written to the JSON file as it is taken."""

    def __init__(self, path: Path, settings: dict[str, object]) -> None:
        self.path = path
        self.data: dict[str, object] = {"settings": settings, "speed": [], "perplexity": []}

    def add(self, kind: str, record: dict[str, object]) -> None:
        self.data[kind].append(record)  # type: ignore[union-attr]
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(json.dumps(self.data, indent=1))


def quiet_enough(max_load: float, settle: float) -> float:
    """The 1-minute load average, once it is below `max_load` or `settle` seconds have passed."""
    deadline = time.monotonic() + settle
    while (load := os.getloadavg()[0]) > max_load and time.monotonic() < deadline:
        time.sleep(2)  # the load average is updated every 5 seconds
    return load


def busy_seconds() -> float | None:
    """CPU seconds every process on the machine has used (Linux's /proc/stat), None elsewhere."""
    try:
        fields = [int(value) for value in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except OSError:
        return None
    idle = fields[3] + fields[4]  # idle, iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def children_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def measured(run: Callable[[], dict[str, object]], args: argparse.Namespace) -> dict[str, object]:
    """`run`'s figures with the load they were taken under: the 1-minute load average before it,
    and the cores other processes kept busy while it ran (all the machine's CPU time less this
    script's children's, over the wall time)."""
    load = quiet_enough(args.max_load, args.settle)
    busy, ours, started = busy_seconds(), children_seconds(), time.perf_counter()
    try:
        figures = run()
    except (RuntimeError, KeyError, ValueError) as error:  # one line, and the run goes on
        print(str(error), file=sys.stderr)
        figures = {"error": str(error)}
    wall = time.perf_counter() - started
    others = None
    if busy is not None and (after := busy_seconds()) is not None:
        others = max(0.0, (after - busy) - (children_seconds() - ours)) / wall
    # Either says another process shared the cores: the load average (what MEASURED.md asks for,
    # though this script's own last run lingers in it for a minute) or others' CPU during the run.
    loaded = load > args.max_load or (others is not None and others > args.max_others)
    return {**figures, "load1": load, "loaded": loaded, "others_cores": others}


def run_checked(command: list[str], about: Path, env: dict[str, str] | None = None) -> tuple[str, str]:
    """(stdout, stderr) of `command`; a failure is one RuntimeError line naming the file."""
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        tail = " ".join((done.stderr or done.stdout).strip().splitlines()[-1:])
        raise RuntimeError(f"{Path(command[0]).name} failed on {about.name}: {tail}")
    return done.stdout, done.stderr


def llama_bench(path: Path, args: argparse.Namespace) -> dict[str, object]:
    options = f"-p {args.prompt} -n {args.tokens} -t {args.threads} -r {args.runs} -o json"
    out, _ = run_checked([str(args.llama_cpp / "llama-bench"), "-m", str(path), *options.split()], path)
    figures: dict[str, object] = {}
    for test in json.loads(out):
        samples = test["samples_ts"]
        figure = [statistics.median(samples), min(samples), max(samples)]
        figures["prefill" if test["n_gen"] == 0 else "decode"] = figure
    return figures


def llmcli_env(mode: str) -> dict[str, str]:
    return {**os.environ, "LLMCLI_CPU_KERNELS": mode}


def llmcli_bench(path: Path, mode: str, args: argparse.Namespace) -> dict[str, object]:
    options = (
        f"--prompt-lengths {args.prompt} -n {args.tokens} --no-generate --runs {args.runs} "
        f"--threads {args.threads} --device cpu --json"
    )
    command = [sys.executable, "-m", "llmcli", "bench", "-m", str(path), *options.split()]
    out, _ = run_checked(command, path, llmcli_env(mode))
    report = json.loads(out)
    spread, prefill_key = report["spread"], f"prefill_tok_s@{args.prompt}"
    return {
        "decode": [report["decode_tok_s"], *spread["decode_tok_s"]],
        "prefill": [report["prefill_tok_s"][str(args.prompt)], *spread[prefill_key]],
        "weight_bytes": report["weight_bytes"],
        "peak_memory_bytes": report.get("peak_memory_bytes"),  # a cross-check: the process's peak
        "held_as": f"{report['dtype']} {report['quant']}",
        # Which kernels multiplied, where bench says so.
        **{key: value for key, value in report.items() if "kernel" in key},
    }


def llama_perplexity(path: Path, args: argparse.Namespace) -> dict[str, object]:
    options = f"-c {args.ppl_ctx} -b {args.ppl_ctx} -t {args.threads}"
    command = [
        str(args.llama_cpp / "llama-perplexity"),
        "-m",
        str(path),
        "-f",
        str(args.text),
        *options.split(),
    ]
    out, log = run_checked(command, path)
    final = re.search(r"Final estimate: PPL = ([0-9.eE+-]+)", out + log)
    if final is None:
        raise RuntimeError(f"llama-perplexity gave no estimate on {path.name} (is --text long enough?)")
    chunks = re.search(r"over (\d+) chunks", out + log)
    return {"ppl": float(final.group(1)), "chunks": int(chunks.group(1)) if chunks else None}


def llmcli_perplexity(path: Path, mode: str, args: argparse.Namespace) -> dict[str, object]:
    given = [str(path), str(args.text), str(args.ppl_ctx), str(args.threads)]
    out, _ = run_checked([sys.executable, "-c", LLMCLI_PERPLEXITY, *given], path, llmcli_env(mode))
    return json.loads(out.strip().splitlines()[-1])


def kernels_in_use(mode: str) -> str:
    """What multiplies GGUF blocks under this LLMCLI_CPU_KERNELS mode, in llmcli's own words: so a
    column that says `auto` but ran torch (the kernels not built) shows it."""
    asked = "from llmcli.models.cpu_kernels import which; print(which())"
    done = subprocess.run([sys.executable, "-c", asked], capture_output=True, text=True, env=llmcli_env(mode))
    lines = (done.stdout if done.returncode == 0 else done.stderr).strip().splitlines()
    return lines[-1] if lines else f"unknown (exit {done.returncode})"


def pick_files(args: argparse.Namespace) -> list[Path]:
    types = [name for name in args.types.split(",") if name] if args.types else []
    files = make_speed_set(args.dir, types, args.llama_cpp) if types else []
    if args.demo:
        from llmcli.models.resolve import demo_gguf_path

        files.append(demo_gguf_path())
    files += args.files
    if not files:
        raise SystemExit("no files to measure: give --types, --files or --demo")
    return files


def engines(args: argparse.Namespace) -> list[str]:
    names = [f"llmcli {mode}" for mode in args.modes.split(",")]
    return ([LLAMA_CPP_COLUMN] if args.has_llama_cpp else []) + names


def speed(path: Path, engine: str, args: argparse.Namespace) -> dict[str, object]:
    if engine == LLAMA_CPP_COLUMN:
        return llama_bench(path, args)
    return llmcli_bench(path, engine.split(" ", 1)[1], args)


def perplexity(path: Path, engine: str, args: argparse.Namespace) -> dict[str, object]:
    if engine == LLAMA_CPP_COLUMN:
        return llama_perplexity(path, args)
    return llmcli_perplexity(path, engine.split(" ", 1)[1], args)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--dir", type=Path, default=DEFAULT_DIR, help="the speed set's cache folder")
    parser.add_argument("--types", default=",".join(TYPES), help="speed-set types, comma-separated ('' none)")
    parser.add_argument("--files", type=Path, nargs="*", default=[], help="other GGUF files to measure")
    parser.add_argument("--demo", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--modes", default="off,auto", help="LLMCLI_CPU_KERNELS values, one column each")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds")
    parser.add_argument("--runs", type=int, default=3, help="runs per round (-r / --runs)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prompt", type=int, default=512, help="prompt tokens for prefill")
    parser.add_argument("--tokens", type=int, default=64, help="decoded tokens")
    parser.add_argument("--ppl", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--text", type=Path, default=QUALITY_TEXT, help="perplexity text")
    parser.add_argument("--ppl-ctx", type=int, default=128, help="perplexity chunk (needs 2× in tokens)")
    parser.add_argument("--max-load", type=float, default=1.5, help="1-minute load a fair figure needs")
    parser.add_argument("--max-others", type=float, default=0.25, help="others' cores a fair figure allows")
    parser.add_argument("--settle", type=float, default=60, help="seconds to wait for that load per run")
    parser.add_argument("--refuse-loaded", action="store_true", help="leave loaded figures out")
    parser.add_argument("--llama-cpp", type=Path, default=LLAMA_CPP, help="llama.cpp's programs")
    parser.add_argument("--out", type=Path, default=None, help="JSON file (default: in --dir)")
    parser.add_argument("--table-from", type=Path, help="print the table of an earlier run's JSON and stop")
    args = parser.parse_args()
    if args.table_from:
        if not args.table_from.is_file():
            raise SystemExit(f"--table-from: {args.table_from} is not a file")
        print(table(json.loads(args.table_from.read_text()), args.refuse_loaded))
        return
    args.has_llama_cpp = (args.llama_cpp / "llama-bench").is_file()
    if not args.has_llama_cpp:
        print(f"{args.llama_cpp}/llama-bench not found: no llama.cpp column", file=sys.stderr)
    files = pick_files(args)
    out = args.out or args.dir / f"bench-llama-cpp-{time.strftime('%Y%m%d-%H%M%S')}.json"
    args.kernels = {f"llmcli {mode}": kernels_in_use(mode) for mode in args.modes.split(",")}
    settings = {key: str(value) for key, value in vars(args).items()}
    settings |= {"cpu_count": os.cpu_count(), "kernels": args.kernels}
    recorder = Recorder(out, settings)
    for round_number in range(args.rounds):
        order = engines(args)
        for path in files:
            for engine in order if round_number % 2 == 0 else order[::-1]:
                record = measured(lambda path=path, engine=engine: speed(path, engine, args), args)
                print(f"round {round_number + 1} {path.stem} {engine}: {_brief(record)}", file=sys.stderr)
                where = {"file": str(path), "file_bytes": path.stat().st_size, "engine": engine}
                recorder.add("speed", {**where, "round": round_number, **record})
    if args.ppl:
        for path in files:
            for engine in engines(args):
                record = measured(lambda path=path, engine=engine: perplexity(path, engine, args), args)
                print(f"perplexity {path.stem} {engine}: {_brief(record)}", file=sys.stderr)
                recorder.add("perplexity", {"file": str(path), "engine": engine, **record})
    print(table(recorder.data, args.refuse_loaded))
    print(f"\nevery figure: {out}")


def _brief(record: dict[str, object]) -> str:
    shown = {key: record[key] for key in ("decode", "prefill", "ppl", "error", "load1") if key in record}
    return json.dumps(shown)


def table(data: dict, refuse_loaded: bool) -> str:
    """One row a file: per engine decode and prefill (llmcli's with its ratio to llama.cpp's),
    llmcli's weights held over the file's size (and as what), and perplexity."""
    speed_rows, ppl_rows, settings = data["speed"], data["perplexity"], data["settings"]
    files = list(dict.fromkeys(row["file"] for row in speed_rows + ppl_rows))
    names = list(dict.fromkeys(row["engine"] for row in speed_rows + ppl_rows))
    names.sort(key=lambda name: name != LLAMA_CPP_COLUMN)
    ours, theirs_too = [name for name in names if name != LLAMA_CPP_COLUMN], LLAMA_CPP_COLUMN in names
    header = ["file", "MB"]
    for measure in ("decode", "prefill"):
        for name in names:
            header += [f"{name} {measure} tok/s"] + (["×"] if name in ours and theirs_too else [])
    header += [f"{name} held/file" for name in ours]
    header += [f"{name} ppl" for name in names] if ppl_rows else []
    header += ["load1 max", "others' cores max"]
    lines = ["| " + " | ".join(header) + " |", "|---|" + "---:|" * (len(header) - 1)]
    for file in files:
        rows = [row for row in speed_rows if row["file"] == file and "error" not in row]
        size = next((row["file_bytes"] for row in speed_rows if row["file"] == file), 0)
        cells = [Path(file).stem.removeprefix(f"{STEM}."), f"{size / 1e6:.0f}"]
        for measure in ("decode", "prefill"):
            theirs = _pooled(rows, LLAMA_CPP_COLUMN, measure, refuse_loaded)
            for name in names:
                figure = _pooled(rows, name, measure, refuse_loaded)
                cells.append(_cell(figure))
                if name in ours and theirs_too:
                    cells.append(f"{figure[0] / theirs[0]:.2f}" if figure and theirs else "—")
        for name in ours:
            held = [row for row in rows if row["engine"] == name]
            cells.append(f"{held[0]['weight_bytes'] / size:.2f} ({held[0]['held_as']})" if held else "—")
        cells += _perplexities(ppl_rows, file, names) if ppl_rows else []
        loads = [row["load1"] for row in rows]
        others = [row["others_cores"] for row in rows if row["others_cores"] is not None]
        cells += [f"{max(loads):.2f}" if loads else "—", f"{max(others):.2f}" if others else "—"]
        lines.append("| " + " | ".join(cells) + " |")
    kernels = "; ".join(f"{name}: {which}" for name, which in settings.get("kernels", {}).items())
    given = {key: settings[key] for key in ("threads", "prompt", "tokens", "rounds", "runs", "ppl_ctx")}
    kept = "left out" if refuse_loaded else "kept"
    note = (
        "{threads} threads · prefill {prompt} tokens · decode {tokens} · median of {rounds} round(s) × "
        "{runs} run(s) (lowest–highest) · perplexity in chunks of {ppl_ctx} (Δ against llama.cpp's)"
    ).format(**given)
    note += f" on {Path(settings['text']).name} · `*`: taken above load {settings['max_load']} "
    note += f"or others' cores {settings.get('max_others', '—')} ({kept})"
    note += f"\nmultiplied by — {kernels}"
    return "\n".join(lines) + "\n\n" + note


def _pooled(rows: list[dict], engine: str, measure: str, refuse_loaded: bool) -> list | None:
    """[median of the rounds' medians, lowest, highest, any taken under load]"""
    mine = [row for row in rows if row["engine"] == engine and measure in row]
    if refuse_loaded:
        mine = [row for row in mine if not row["loaded"]]
    if not mine:
        return None
    figures = [row[measure] for row in mine]
    return [
        statistics.median(f[0] for f in figures),
        min(f[1] for f in figures),
        max(f[2] for f in figures),
        any(row["loaded"] for row in mine),
    ]


def _cell(figure: list | None) -> str:
    if figure is None:
        return "—"
    median, low, high, loaded = figure
    return f"{median:.1f} ({low:.1f}–{high:.1f}){'*' if loaded else ''}"


def _perplexities(rows: list[dict], file: str, names: list[str]) -> list[str]:
    found = {row["engine"]: row for row in rows if row["file"] == file and "ppl" in row}
    theirs = found.get(LLAMA_CPP_COLUMN)
    cells = []
    for name in names:
        row = found.get(name)
        if row is None:
            cells.append("—")
        elif name == LLAMA_CPP_COLUMN or theirs is None:
            cells.append(f"{row['ppl']:.4g}")
        else:
            cells.append(f"{row['ppl']:.4g} ({100 * (row['ppl'] / theirs['ppl'] - 1):+.2f} %)")
    return cells


if __name__ == "__main__":
    main()
