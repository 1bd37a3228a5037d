"""`llmcli bench` reports as Markdown tables: what a person reads on a terminal or pastes in
an issue. The measurements are the engine's (engine/bench.py, engine/speculative/bench.py)."""

from __future__ import annotations

from llmcli.engine.batch_bench import ConcurrencyReport
from llmcli.engine.bench import BenchReport
from llmcli.engine.speculative.bench import SpeculativeBenchReport
from llmcli.models.memory import format_bytes


def render_table(report: BenchReport) -> str:
    """Each figure as its median with the lowest and highest run beside it; a contender that
    did not run (transformers' compiled path off CUDA) has no column."""

    def ms(seconds: float | None, figure: str) -> str:
        return _with_spread(seconds, report.spread.get(figure), 1000, 1)

    def num(value: float | None, figure: str = "", digits: int = 1) -> str:
        return _with_spread(value, report.spread.get(figure), 1, digits)

    def pct_of_bandwidth(achieved: float | None) -> str:
        return num(None if achieved is None else 100 * achieved / report.bandwidth_gb_s)

    columns = ["llmcli"]
    if report.generate_decode_tok_s is not None:
        columns.append("model.generate")
    if report.compiled_decode_tok_s is not None:
        columns.append("compiled static")
    first_length = next(iter(report.prefill_tok_s))
    rows: list[tuple[str, ...]] = [
        (f"prefill tok/s @ {n}", num(rate, f"prefill_tok_s@{n}"), "", "")
        for n, rate in report.prefill_tok_s.items()
    ]
    rows += [
        (
            f"TTFT ms @ {first_length}",
            ms(report.ttft_s, "ttft_s"),
            ms(report.generate_ttft_s, "generate_ttft_s"),
            "",
        ),
        (
            f"decode tok/s @ {first_length}",
            num(report.decode_tok_s, "decode_tok_s"),
            num(report.generate_decode_tok_s, "generate_decode_tok_s"),
            num(report.compiled_decode_tok_s, "compiled_decode_tok_s"),
        ),
    ]
    if report.context_fill is not None:
        rows.append(
            (
                f"decode tok/s @ {report.context_fill}",
                num(report.decode_tok_s_at_fill, "decode_tok_s_at_fill"),
                "",
                "",
            )
        )
    rows += [
        ("inter-token ms p50 / p99", f"{report.itl_p50_ms:.2f} / {report.itl_p99_ms:.2f}", "", ""),
        ("achieved GB/s", num(report.achieved_gb_s), num(report.generate_achieved_gb_s), ""),
        (
            "% of measured bandwidth",
            num(report.roofline_pct),
            pct_of_bandwidth(report.generate_achieved_gb_s),
            "",
        ),
        ("peak memory", format_bytes(report.peak_memory_bytes), "", ""),
    ]
    kernels = f"CPU kernels {report.cpu_kernels} · " if report.cpu_kernels else ""
    head = (
        f"{report.model} · {report.device} · {report.dtype} · quant {report.quant} · {kernels}"
        f"engine {report.engine}{' with CUDA graphs' if report.graphs else ''} · "
        f"weights {format_bytes(report.weight_bytes)}{_whose(report)} · "
        f"bandwidth {report.bandwidth_gb_s:.1f} GB/s (measured) · "
        f"{report.new_tokens} new tokens · median (lowest–highest) of {report.runs} runs"
    )
    cells = [(name, *values[: len(columns)]) for name, *values in rows]
    widths = [max(len(row[i]) for row in [("", *columns), *cells]) for i in range(len(columns) + 1)]
    lines = [
        head,
        "",
        "| "
        + " | ".join(
            cell.rjust(w) if i else cell.ljust(w)
            for i, (cell, w) in enumerate(zip(("", *columns), widths, strict=True))
        )
        + " |",
        "|" + "|".join("-" * (w + 2) for w in widths) + "|",
    ]
    lines += [
        "| "
        + " | ".join(
            cell.rjust(w) if i else cell.ljust(w) for i, (cell, w) in enumerate(zip(row, widths, strict=True))
        )
        + " |"
        for row in cells
    ]
    lines.append("")
    if report.ceiling_tok_s is not None:
        lines.append(
            f"ceiling (the linear layers alone, one GEMV each{', one CUDA graph' if report.graphs else ''}): "
            f"{report.ceiling_tok_s:.1f} tok/s; llmcli reaches {report.ceiling_pct:.0f} % of it"
        )
        if report.ceiling_left_out:  # said, never silently left out of the ceiling
            lines.append(f"the ceiling leaves out: {', '.join(report.ceiling_left_out)}")
    if report.speedup_vs_generate is not None:
        lines.append(f"llmcli decodes {report.speedup_vs_generate:.2f}× as fast as model.generate")
    if report.speedup_vs_compiled is not None:
        lines.append(
            f"llmcli decodes {report.speedup_vs_compiled:.2f}× as fast as transformers' compiled path"
        )
    return "\n".join(lines)


def _with_spread(value: float | None, spread: tuple[float, float] | None, scale: float, digits: int) -> str:
    if value is None:
        return "—"
    text = f"{value * scale:.{digits}f}"
    if spread is not None:
        low, high = spread
        text += f" ({low * scale:.{digits}f}–{high * scale:.{digits}f})"
    return text


def render_speculative_table(report: SpeculativeBenchReport) -> str:
    draft = f" (draft model {report.draft})" if report.method == "draft" and report.draft else ""
    head = (
        f"{report.model} · {report.device} · {report.dtype} · quant {report.quant} · "
        f"engine {report.engine}{' with CUDA graphs' if report.graphs else ''} · "
        f"--speculative {report.method}{draft} · greedy, ≤ {report.new_tokens} new tokens · "
        f"median of {report.runs} runs"
    )
    if report.int4_cuda_kernel:
        head += f" · int4 kernel {report.int4_cuda_kernel}"
    lines = [
        head,
        "",
        "| task | tokens | off tok/s | speculative tok/s | speed-up | accepted/drafted | same tokens |",
        "|---|---:|---:|---:|---:|---:|---|",
    ]
    for row in report.rows:
        rate = f" ({row.accepted / row.drafted:.0%})" if row.drafted else ""
        lines.append(
            f"| {row.task} | {row.tokens} | {row.off_tok_s:.1f} | {row.on_tok_s:.1f} | "
            f"{row.speedup:.2f}× | {row.accepted}/{row.drafted}{rate} | "
            f"{'yes' if row.same_tokens else 'no'} |"
        )
    if report.skipped:
        lines += ["", f"Skipped, too long for the model's context: {'; '.join(report.skipped)}."]
    if report.random_weights:
        lines += ["", "Random weights: the speed-up above depends on the text written; the table below not."]
    step_ms = report.decode_step_s * 1000
    lines += [
        "",
        f"One pass of the model over K tokens after {report.context} cached (the cache cropped back):",
        "",
        "| K | ms | × a decode step | ms per token | drafts pay above (acceptance per token) |",
        "|---:|---:|---:|---:|---:|",
        f"| 1 (decode step) | {step_ms:.2f} | 1.00 | {step_ms:.2f} | |",
    ]
    for count, seconds in report.check_s.items():
        lines.append(
            f"| {count} | {seconds * 1000:.2f} | {seconds / report.decode_step_s:.2f} | "
            f"{seconds * 1000 / count:.2f} | {report.break_even(count):.2f} |"
        )
    return "\n".join(lines)


def render_concurrency_table(report: ConcurrencyReport) -> str:
    head = (
        f"{report.model} · {report.device} · {report.dtype} · quant {report.quant} · "
        f"{report.prompt_length}-token prompts, {report.new_tokens} greedy steps, {report.steps} · "
        f"median of {report.runs} runs (lowest–highest)"
    )
    if report.batched_eager_reason is not None and report.steps != "eager":
        head += f" · several sequences' step eager: {report.batched_eager_reason}"
    lines = [
        head,
        "",
        "| sequences | aggregate tok/s | per sequence tok/s | × one alone | KV held | KV tokens held |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for level in report.levels:
        aggregate = _with_spread(level.aggregate_tok_s, level.spread, 1, 1)
        lines.append(
            f"| {level.sequences} | {aggregate} | {level.per_sequence_tok_s:.1f} | "
            f"{level.versus_one:.2f}× | {format_bytes(level.kv_bytes)} | {level.kv_tokens} |"
        )
    lines += [
        "",
        f"One sequence on the engine's own step and cache: {report.single_stream_tok_s:.1f} tok/s; "
        f"one alone in a slot of the pool (above, 1) {report.lone_versus_single_stream:.3f}× that.",
        f"KV bytes per token: {format_bytes(report.kv_bytes_per_token)}; the caches grow in "
        "buckets (a power of two ≥ 256 tokens), so KV held is what they reserve.",
    ]
    return "\n".join(lines)


def _whose(report: BenchReport) -> str:
    """Why the weights may differ from `generate --json`'s figure: this load is transformers'."""
    if not report.transformers_model:
        return ""
    return " (as transformers' model holds them, for model.generate; --no-generate loads as generate does)"
