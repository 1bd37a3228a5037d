"""`llmcli bench`: prefill, TTFT, decode and memory, against `model.generate` in the same run.

Decode at batch 1 reads every weight once per token, so its floor is weight bytes ÷ memory
bandwidth. We measure that bandwidth on the spot (a large device-to-device copy) and report how
close decoding comes to it: achieved GB/s = (weight bytes + KV bytes read) × tokens/s.
Every figure is the median of several runs after a warm-up; llmcli's and `model.generate`'s runs
are interleaved so drift in machine speed hits both alike.
"""

from __future__ import annotations

import resource
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from llmcli.config.settings import SamplingParams
from llmcli.engine.loop import Engine
from llmcli.models.load import LoadedModel


@dataclass
class BenchReport:
    model: str
    device: str
    dtype: str
    quant: str
    fast: bool
    weight_bytes: int
    kv_bytes_per_token: int
    runs: int
    new_tokens: int
    bandwidth_gb_s: float  # measured now, device to device
    prefill_tok_s: dict[int, float] = field(default_factory=dict)  # prompt length → tok/s
    ttft_s: float = 0.0
    decode_tok_s: float = 0.0
    itl_p50_ms: float = 0.0
    itl_p99_ms: float = 0.0
    achieved_gb_s: float = 0.0
    roofline_pct: float = 0.0
    peak_memory_bytes: int = 0
    generate_ttft_s: float | None = None
    generate_decode_tok_s: float | None = None
    generate_achieved_gb_s: float | None = None
    speedup_vs_generate: float | None = None

    def as_dict(self) -> dict[str, Any]:
        record = asdict(self)
        record["prefill_tok_s"] = {str(k): v for k, v in self.prefill_tok_s.items()}
        return record


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], object], device: torch.device) -> float:
    synchronize(device)
    start = time.perf_counter()
    fn()
    synchronize(device)
    return time.perf_counter() - start


def interleaved_medians(
    fns: dict[str, Callable[[], object]], runs: int, device: torch.device
) -> dict[str, float]:
    """Median wall time of each function over `runs`, the runs interleaved, after one warm-up."""
    for fn in fns.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(runs):
        for name, fn in fns.items():
            times[name].append(timed(fn, device))
    return {name: statistics.median(values) for name, values in times.items()}


def measure_bandwidth(device: torch.device, size_bytes: int | None = None, repeats: int = 5) -> float:
    """Device memory bandwidth in GB/s: a large copy reads and writes every byte once."""
    size = size_bytes or (1 << 30 if device.type == "cuda" else 1 << 28)
    source = torch.empty(size, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    target.copy_(source)  # warm-up: page in both buffers
    seconds = statistics.median(timed(lambda: target.copy_(source), device) for _ in range(repeats))
    return 2 * size / seconds / 1e9


def ours(engine: Engine, prompt: list[int], new_tokens: int) -> Callable[[], Any]:
    """One generation of exactly `new_tokens` tokens (end-of-sequence ignored) from an empty cache."""
    params = SamplingParams(temperature=0.0, max_new_tokens=new_tokens)

    def run() -> Any:
        engine.reset()
        generation = engine.generate(prompt, params, None)
        for _ in generation:
            pass
        return generation.result

    return run


def baseline(model: Any, prompt: list[int], new_tokens: int) -> Callable[[], Any]:
    input_ids = torch.tensor([prompt], device=model.device)
    attention_mask = torch.ones_like(input_ids)

    def run() -> Any:
        with torch.inference_mode():
            return model.generate(
                input_ids,
                attention_mask=attention_mask,
                do_sample=False,
                max_new_tokens=new_tokens,
                min_new_tokens=0,
                eos_token_id=None,
                pad_token_id=0,
            )

    return run


def prompt_of(length: int, vocab_size: int) -> list[int]:
    generator = torch.Generator().manual_seed(length)
    return torch.randint(0, vocab_size, (length,), generator=generator).tolist()


def run_bench(
    loaded: LoadedModel,
    *,
    prompt_lengths: list[int],
    new_tokens: int,
    runs: int,
    with_generate: bool = True,
    engine: Engine | None = None,
) -> BenchReport:
    device = loaded.device
    vocab = loaded.model.config.get_text_config().vocab_size
    # End-of-sequence off: every run produces exactly the tokens asked for.
    engine = engine or Engine.for_loaded(loaded)
    engine.eos_token_ids = frozenset()
    lengths = [n for n in prompt_lengths if n + new_tokens <= loaded.context_length] or [16]
    report = BenchReport(
        model=loaded.name,
        device=str(device),
        dtype=loaded.dtype_name,
        quant=loaded.quant,
        fast=engine.static_cache,
        weight_bytes=loaded.weight_bytes,
        kv_bytes_per_token=loaded.kv_bytes_per_token,
        runs=runs,
        new_tokens=new_tokens,
        bandwidth_gb_s=measure_bandwidth(device),
    )
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)

    for length in lengths:
        prompt = prompt_of(length, vocab)

        def prefill(prompt: list[int] = prompt) -> None:
            engine.reset()
            engine.prefill(prompt)

        report.prefill_tok_s[length] = (
            length / interleaved_medians({"prefill": prefill}, runs, device)["prefill"]
        )

    prompt = prompt_of(lengths[0], vocab)
    contenders = {"ours/1": ours(engine, prompt, 1), "ours/n": ours(engine, prompt, new_tokens)}
    if with_generate:
        contenders |= {
            "generate/1": baseline(loaded.model, prompt, 1),
            "generate/n": baseline(loaded.model, prompt, new_tokens),
        }
    medians = interleaved_medians(contenders, runs, device)
    results = [ours(engine, prompt, new_tokens)() for _ in range(runs)]
    gaps = sorted(gap for result in results for gap in result.stats.inter_token_s)
    report.ttft_s = statistics.median(result.stats.ttft_s for result in results)
    report.decode_tok_s = (new_tokens - 1) / (medians["ours/n"] - medians["ours/1"])
    report.itl_p50_ms = 1000 * gaps[len(gaps) // 2] if gaps else 0.0
    report.itl_p99_ms = 1000 * gaps[min(len(gaps) - 1, int(len(gaps) * 0.99))] if gaps else 0.0
    bytes_per_token = loaded.weight_bytes + loaded.kv_bytes_per_token * (lengths[0] + new_tokens / 2)
    report.achieved_gb_s = bytes_per_token * report.decode_tok_s / 1e9
    report.roofline_pct = 100 * report.achieved_gb_s / report.bandwidth_gb_s
    if with_generate:
        report.generate_ttft_s = medians["generate/1"]
        report.generate_decode_tok_s = (new_tokens - 1) / (medians["generate/n"] - medians["generate/1"])
        report.generate_achieved_gb_s = bytes_per_token * report.generate_decode_tok_s / 1e9
        report.speedup_vs_generate = report.decode_tok_s / report.generate_decode_tok_s
    report.peak_memory_bytes = peak_memory(device)
    return report


def peak_memory(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    scale = 1 if sys.platform == "darwin" else 1024  # ru_maxrss is bytes on macOS, KiB on Linux
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale


def render_table(report: BenchReport) -> str:
    from llmcli.models.memory import format_bytes

    def ms(seconds: float | None) -> str:
        return "—" if seconds is None else f"{seconds * 1000:.1f}"

    def num(value: float | None, digits: int = 1) -> str:
        return "—" if value is None else f"{value:.{digits}f}"

    rows = [(f"prefill tok/s @ {n}", num(rate), "") for n, rate in report.prefill_tok_s.items()]
    rows += [
        (f"TTFT ms @ {next(iter(report.prefill_tok_s))}", ms(report.ttft_s), ms(report.generate_ttft_s)),
        ("decode tok/s", num(report.decode_tok_s), num(report.generate_decode_tok_s)),
        ("inter-token ms p50 / p99", f"{report.itl_p50_ms:.2f} / {report.itl_p99_ms:.2f}", ""),
        ("achieved GB/s", num(report.achieved_gb_s), num(report.generate_achieved_gb_s)),
        (
            "% of measured bandwidth",
            num(report.roofline_pct),
            num(
                None
                if report.generate_achieved_gb_s is None
                else 100 * report.generate_achieved_gb_s / report.bandwidth_gb_s
            ),
        ),
        ("peak memory", format_bytes(report.peak_memory_bytes), ""),
    ]
    head = (
        f"{report.model} · {report.device} · {report.dtype} · quant {report.quant} · fast {report.fast} · "
        f"weights {format_bytes(report.weight_bytes)} · "
        f"bandwidth {report.bandwidth_gb_s:.1f} GB/s (measured) · "
        f"{report.new_tokens} new tokens · median of {report.runs} runs"
    )
    lines = [
        head,
        "",
        f"| {'':26} | {'llmcli':>14} | {'model.generate':>14} |",
        f"|{'-' * 28}|{'-' * 16}|{'-' * 16}|",
    ]
    lines += [f"| {name:26} | {ours:>14} | {theirs:>14} |" for name, ours, theirs in rows]
    if report.speedup_vs_generate is not None:
        lines += ["", f"llmcli decodes {report.speedup_vs_generate:.2f}× as fast as model.generate"]
    return "\n".join(lines)
