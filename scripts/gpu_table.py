"""Issue 45's GPU targets as one table, from the folder a `scripts/gpu_figures.sh` run wrote: each
target, what was measured, the ratio it is judged on, and whether it is met — with the card named.
A step that did not run, ran out of time, failed or was cut off by the lease's end gives its row
"not measured: <why>", never a guess. It reads the steps' own machine-readable outputs (`llmcli
bench --json`, the scripts' JSON, pytest's -v lines), so it can be run again on what a cut lease
brought back. Imports no torch: gpu_figures.sh runs it after every step.

    python scripts/gpu_table.py OUTDIR
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

TIMED_OUT = {124, 137}  # timeout(1)'s status, and a kill after it


class NotMeasured(Exception):
    """Why a row has no figure."""


@dataclass(frozen=True)
class Row:
    target: str
    measured: str
    ratio: str
    met: bool | None  # None: nothing to judge


class Run:
    """The folder of one run: each step's NAME.out, NAME.err and NAME.rc ("rc seconds limit", or
    "skipped 0 seconds-left")."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder

    def text(self, name: str, any_exit: bool = False) -> str:
        """The step's stdout, or NotMeasured saying why there is none to read. `any_exit`: its
        output read whatever its exit (pytest's lines say which tests ran, cut or failed)."""
        out, status = self.folder / f"{name}.out", self.folder / f"{name}.rc"
        if not status.exists():
            if out.exists() and not any_exit:
                raise NotMeasured(f"{name} was cut off while it ran (the run ended)")
            if not out.exists():
                raise NotMeasured(f"{name} did not run (not asked for, or the run ended before it)")
            return out.read_text()
        rc, _, limit = status.read_text().split()
        if rc == "skipped":
            raise NotMeasured(f"{name} skipped: the run's time budget was spent")
        if any_exit:
            return out.read_text() if out.exists() else ""
        if int(rc) in TIMED_OUT:
            raise NotMeasured(f"{name} ran out of its {limit} s")
        if int(rc) != 0:
            raise NotMeasured(f"{name} failed (exit {rc}): {self.last_error(name)}")
        return out.read_text() if out.exists() else ""

    def cut(self, name: str) -> bool:
        """Whether the step was stopped before it ended: by its limit, or by the run's end."""
        status = self.folder / f"{name}.rc"
        if not status.exists():
            return (self.folder / f"{name}.out").exists()
        rc = status.read_text().split()[0]
        return rc != "skipped" and int(rc) in TIMED_OUT

    def json(self, name: str) -> dict[str, Any]:
        """The step's JSON object: the last line of its stdout that is one."""
        for line in reversed(self.text(name).splitlines()):
            if line.startswith("{"):
                try:
                    return json.loads(line)
                except ValueError:
                    break
        raise NotMeasured(f"{name} printed no JSON")

    def last_error(self, name: str) -> str:
        err = self.folder / f"{name}.err"
        lines = (
            [line.strip() for line in err.read_text().splitlines() if line.strip()] if err.exists() else []
        )
        return lines[-1][:160] if lines else "nothing on stderr"

    def steps(self) -> Iterator[str]:
        """One line per step that ran: its name, exit status and seconds."""
        for status in sorted(self.folder.glob("*.rc"), key=lambda path: path.stat().st_mtime):
            rc, seconds, limit = status.read_text().split()
            yield f"{status.stem} {'skipped' if rc == 'skipped' else f'rc {rc}, {seconds} s of {limit}'}"


def pct(value: float) -> str:
    return f"{value:.1f} %"


def times(value: float) -> str:
    return f"{value:.2f}×"


def ceiling_row(run: Run, target: str, step: str, least: float) -> Row:
    report = run.json(step)
    measured = f"{report['decode_tok_s']:.1f} tok/s; ceiling {report['ceiling_tok_s']:.1f}"
    return Row(target, measured, pct(report["ceiling_pct"]), report["ceiling_pct"] >= least)


def levels(run: Run, step: str) -> dict[int, dict[str, Any]]:
    return {level["sequences"]: level for level in run.json(step)["levels"]}


def streams_row(run: Run, target: str, step: str, many: int, least: float) -> Row:
    by_count = levels(run, step)
    if many not in by_count:
        raise NotMeasured(f"{step} measured {sorted(by_count)} streams, not {many}")
    crowd, alone = by_count[many], by_count[1]
    measured = f"{crowd['aggregate_tok_s']:.1f} tok/s together; {alone['aggregate_tok_s']:.1f} alone"
    return Row(target, measured, times(crowd["versus_one"]), crowd["versus_one"] >= least)


def lone_stream_row(run: Run, target: str, step: str, single: str) -> Row:
    """One sequence in a slot of the streams' pool against the engine's own single-stream graph:
    measured in the same bench run where it gives `single_stream_tok_s`, else `single`'s decode."""
    report = run.json(step)
    alone = levels(run, step)[1]["aggregate_tok_s"]
    graph, where = report.get("single_stream_tok_s") or 0.0, step
    if not graph:
        graph, where = run.json(single)["decode_tok_s"], single
    measured = f"{alone:.1f} tok/s alone in a slot; {graph:.1f} on its own graph ({where})"
    return Row(target, measured, times(alone / graph), alone / graph >= 0.97)


def kquant_rows(run: Run, target: str) -> list[Row]:
    """A row per GGUF type the kernels were timed on (or refused)."""
    report = run.json("kquant-gemv")
    if report.get("status") != "measured":
        raise NotMeasured(f"kquant-gemv: {report.get('status')}: {report.get('why')}")
    rows = []
    for type_name, figures in report["types"].items():
        measured = (
            f"{figures['gb_s']:.0f} GB/s of {report['bandwidth_gb_s']:.0f}; "
            f"a step's GEMVs {figures['step_ms']:.2f} ms"
        )
        share = figures["pct_of_bandwidth"]
        rows.append(Row(f"{target} ({type_name})", measured, pct(share), share >= 70))
    for type_name, why in report["failed"].items():
        rows.append(Row(f"{target} ({type_name})", f"not measured: {why}", "", None))
    return rows


def kquant_file_row(run: Run, target: str) -> Row:
    report = run.json("kquant-decode")
    if "decode_tok_s" not in report:
        raise NotMeasured(f"kquant-decode: {report.get('why')}")
    int4 = run.json("ceiling-8b-int4")["decode_tok_s"]
    ratio = report["decode_tok_s"] / int4
    measured = f"{report['decode_tok_s']:.1f} tok/s ({report['quant']}); int4 {int4:.1f}"
    return Row(target, measured, times(ratio), ratio >= 0.9)


def speculative_row(run: Run, target: str) -> Row:
    """On random weights nothing repeats, so lookup drafts nothing on the bench's own prompt: the
    copy-heavy stand-in is the replay row whose drafts are the plain run's tokens, one in ten wrong
    (speculative/bench.py), timed beside plain decode in the same run."""
    report = run.json("spec-8b-lookup")
    if not report["rows"]:
        raise NotMeasured(f"spec-8b-lookup ran no task: {'; '.join(report['skipped'])}")
    replayed = [row for row in report["rows"] if "1 in 10 wrong" in row["task"]]
    row = replayed[0] if report["random_weights"] and replayed else report["rows"][0]
    measured = (
        f"{row['on_tok_s']:.1f} vs {row['off_tok_s']:.1f} tok/s, {row['accepted']}/{row['drafted']} "
        f"accepted, same tokens: {'yes' if row['same_tokens'] else 'NO'}"
    )
    checks = report["check_s"]
    if "8" in checks:  # what a draft of 8 costs to check: the most lookup can gain is 9 ÷ this
        measured += f"; checking 8 costs {checks['8'] / report['decode_step_s']:.2f} steps"
    if report["random_weights"]:
        measured += f"; random weights: {row['task']}"
    return Row(target, measured, times(row["speedup"]), row["speedup"] >= 1.5 and row["same_tokens"])


def first_token_row(run: Run, target: str, step: str, most: float) -> Row:
    report = run.json(step)
    stages = " · ".join(f"{stage} {seconds:.2f}" for stage, seconds in report["breakdown_s"].items())
    seconds = report["first_byte_s"]
    measured = f"first byte {seconds:.2f} s; in-process: {stages} s"
    return Row(target, measured, f"{seconds:.2f} s", seconds <= most)


def tests_row(run: Run, target: str) -> Row:
    """pytest's -v lines, one a test, counted: they are there even when the step was cut before
    its summary. A test file that did not collect (a package the GPU image lacks) is named apart:
    it hides only its own tests."""
    text = run.text("gpu-tests", any_exit=True)
    outcomes = re.findall(r"^\S*::.*? (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\b", text, re.MULTILINE)
    counts = {word: outcomes.count(word) for word in ("PASSED", "FAILED", "ERROR", "SKIPPED")}
    measured = ", ".join(f"{count} {word.lower()}" for word, count in counts.items() if count)
    # by file name: pytest writes the path from a root that depends on where the tests lie
    uncollected = sorted({Path(path).name for path in re.findall(r"ERROR collecting (\S+)", text)})
    if uncollected:
        measured += f"; did not collect: {', '.join(uncollected)}"
    if run.cut("gpu-tests"):
        measured += "; cut off before the end"
    if counts["PASSED"] == 0:
        return Row(target, f"no test ran on a GPU ({measured or 'none collected'})", "", None)
    failed = counts["FAILED"] + counts["ERROR"]
    return Row(target, measured, f"{failed} failed", failed == 0)


# Each target as the issue words it, and how its row is made from a run; by what it is worth.
TARGETS: list[tuple[str, Callable[[Run, str], Row | list[Row]]]] = [
    (
        "8B bf16 batch 1 ≥ 95 % of its linear-layers ceiling",
        lambda r, t: ceiling_row(r, t, "ceiling-8b-bf16", 95),
    ),
    (
        "8B int4 batch 1 ≥ 75 % of its linear-layers ceiling",
        lambda r, t: ceiling_row(r, t, "ceiling-8b-int4", 75),
    ),
    (
        "1B bf16 batch 1 ≥ 85 % of its linear-layers ceiling",
        lambda r, t: ceiling_row(r, t, "ceiling-1b-bf16", 85),
    ),
    ("1B bf16, 8 streams ≥ 5× one stream", lambda r, t: streams_row(r, t, "streams-1b", 8, 5)),
    ("8B bf16, 16 streams ≥ 8× one stream", lambda r, t: streams_row(r, t, "streams-8b", 16, 8)),
    (
        "1B bf16: a lone stream within 3 % of the single-stream graph",
        lambda r, t: lone_stream_row(r, t, "streams-1b", "ceiling-1b-bf16"),
    ),
    (
        "8B bf16: a lone stream within 3 % of the single-stream graph",
        lambda r, t: lone_stream_row(r, t, "streams-8b", "ceiling-8b-bf16"),
    ),
    ("K-quant GEMV ≥ 70 % of copy bandwidth on 8B shapes", kquant_rows),
    ("a Q4_K_M file's decode ≥ 0.9× the same model's int4 (8B)", kquant_file_row),
    ("speculative (lookup, copy-heavy prompt) ≥ 1.5× plain decode on the 8B, same text", speculative_row),
    (
        "one-shot first token from the page cache, 1B ≤ 4 s",
        lambda r, t: first_token_row(r, t, "first-token-1b", 4),
    ),
    (
        "one-shot first token from the page cache, 8B ≤ 8 s",
        lambda r, t: first_token_row(r, t, "first-token-8b", 8),
    ),
    ("pytest -m gpu: every test passes", tests_row),
]


def rows(run: Run) -> list[Row]:
    table: list[Row] = []
    for target, make in TARGETS:
        try:
            made = make(run, target)
        except NotMeasured as why:
            made = Row(target, f"not measured: {why}", "", None)
        except (KeyError, TypeError, ValueError, ZeroDivisionError) as error:  # an output of another shape
            made = Row(
                target, f"not measured: its output did not read ({type(error).__name__}: {error})", "", None
            )
        table.extend(made if isinstance(made, list) else [made])
    return table


def card_line(run: Run) -> str:
    try:
        card = run.json("card")
    except NotMeasured as why:
        return f"Card: not recorded ({why})"
    parts = [card.get("card") or "unknown", f"torch {card.get('torch')}"]
    parts += [f"CUDA {card['cuda']}"] if card.get("cuda") else []
    parts += [f"driver {card['driver']}"] if card.get("driver") else []
    return "Card: " + " · ".join(parts)


def render(run: Run) -> str:
    lines = [card_line(run)]
    settings = run.folder / "run.txt"
    if settings.exists():
        lines.append(f"Run: {settings.read_text().strip()}")
    lines += ["", "| target | measured | ratio | met? |", "|---|---|---:|---|"]
    verdicts = {True: "met", False: "**missed**", None: "—"}
    for row in rows(run):
        lines.append(f"| {row.target} | {row.measured} | {row.ratio} | {verdicts[row.met]} |")
    lines += ["", "Steps: " + "; ".join(run.steps())]
    return "\n".join(lines)


def main() -> None:
    if len(sys.argv) != 2 or not Path(sys.argv[1]).is_dir():
        sys.exit("usage: python scripts/gpu_table.py OUTDIR (a folder scripts/gpu_figures.sh wrote)")
    print(render(Run(Path(sys.argv[1]))))


if __name__ == "__main__":
    main()
