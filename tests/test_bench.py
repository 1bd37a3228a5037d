"""`llmcli bench` end to end on tiny models, on CPU."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from llmcli.models import cpu_kernels

from cli_helpers import run_cli

REPORT_FIELDS = (
    "model",
    "device",
    "dtype",
    "quant",
    "engine",
    "graphs",
    "weight_bytes",
    "kv_bytes_per_token",
    "runs",
    "new_tokens",
    "bandwidth_gb_s",
    "prefill_tok_s",
    "ttft_s",
    "decode_tok_s",
    "itl_p50_ms",
    "itl_p99_ms",
    "achieved_gb_s",
    "roofline_pct",
    "peak_memory_bytes",
    "generate_ttft_s",
    "generate_decode_tok_s",
    "generate_achieved_gb_s",
    "speedup_vs_generate",
    "compiled_decode_tok_s",
    "ceiling_tok_s",
    "ceiling_pct",
    "context_fill",
    "decode_tok_s_at_fill",
    "transformers_model",
    "cpu_kernels",
)
# 24 new tokens: decode speed is T(24) - T(1), which must stay well above the noise of a busy machine.
QUICK = ["--runs", "3", "-n", "24", "--prompt-lengths", "16,32", "--device", "cpu"]


@pytest.mark.parametrize("engine", ["native", "transformers"])
def test_bench_on_random_weights_reports_every_field(tiny_llama: Path, engine: str) -> None:
    proc = run_cli(
        "bench",
        "--config",
        str(tiny_llama / "config.json"),
        "--random-weights",
        "--json",
        "--engine",
        engine,
        "--context-fill",
        "200",
        *QUICK,
    )
    assert proc.returncode == 0, proc.stderr.decode()
    report = json.loads(proc.stdout)
    assert set(REPORT_FIELDS) <= set(report)
    assert report["engine"] == engine and report["graphs"] is False  # no CUDA here
    assert report["compiled_decode_tok_s"] is None  # transformers' compiled path: CUDA only
    assert report["context_fill"] == 200 and report["decode_tok_s_at_fill"] > 0
    # The ceiling is one pass over the weights alone; how close decoding comes is their ratio.
    # (On an idle machine decode stays below it; a busy one can slow either measurement.)
    assert report["ceiling_pct"] == pytest.approx(100 * report["decode_tok_s"] / report["ceiling_tok_s"])
    for figure in ("ttft_s", "prefill_tok_s@16", "generate_ttft_s"):
        low, high = report["spread"][figure]
        assert 0 < low <= high, figure
    assert set(report["prefill_tok_s"]) == {"16", "32"}
    for name in (
        "bandwidth_gb_s",
        "ttft_s",
        "decode_tok_s",
        "achieved_gb_s",
        "roofline_pct",
        "generate_decode_tok_s",
        "speedup_vs_generate",
        "weight_bytes",
        "peak_memory_bytes",
    ):
        assert report[name] > 0, name
    assert report["itl_p99_ms"] >= report["itl_p50_ms"] > 0
    assert report["model"].endswith("(random weights)")
    assert report["cpu_kernels"] == cpu_kernels.which_on(torch.device("cpu"), report["quant"])
    assert report["transformers_model"] is True  # model.generate timed: transformers' model loaded


def test_bench_table_on_a_real_tiny_model(tiny_llama: Path) -> None:
    proc = run_cli("bench", "-m", str(tiny_llama), *QUICK)
    assert proc.returncode == 0, proc.stderr.decode()
    out = proc.stdout.decode()
    for row in (
        "prefill tok/s @ 16",
        "TTFT ms @ 16",
        "decode tok/s",
        "inter-token ms p50 / p99",
        "% of measured bandwidth",
        "peak memory",
        "model.generate",
        "ceiling (the linear layers alone",
        "engine native",
        f"CPU kernels {cpu_kernels.which_on(torch.device('cpu'), 'none')} · ",  # a float model: torch
        "median (lowest–highest) of 3 runs",
    ):
        assert row in out
    assert "compiled static" not in out  # transformers' compiled path runs on CUDA only
    assert re.search(r"TTFT ms @ 16 +\| +[\d.]+ \([\d.]+–[\d.]+\)", out), out


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--config", "x.json"], "add --random-weights"),
        (["--random-weights"], "needs --config"),
        (["--prompt-lengths", "a,b"], "--prompt-lengths must be integers"),
        (["--concurrency", "2,x"], "--concurrency must be integers"),
        (["--concurrency", "0,2"], "--concurrency levels must be between 1 and"),
        (["--concurrency", "2", "--context-fill", "64"], "--context-fill does not apply"),
        (["--concurrency", "2", "--speculative", "lookup"], "--speculative does not apply"),
        (["--concurrency", "2", "--no-generate"], "--generate/--no-generate does not apply"),
        (["--concurrency", "2", "--prompt-lengths", "64,128"], "--concurrency measures one prompt length"),
        (["--speculative", "lookup", "--prompt-lengths", "6,9"], "--speculative measures one prompt length"),
    ],
)
def test_bench_usage_errors(args: list[str], message: str) -> None:
    proc = run_cli("bench", *args)
    assert proc.returncode == 2 and message in proc.stderr.decode()


def test_shipped_configs_have_the_documented_sizes() -> None:
    """configs/ holds the shapes the GPU benchmarks use (the GPU machine has no Hub)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    root = Path(__file__).parent.parent / "configs"
    for name, billions in (("llama-3.2-1b.json", 1.236), ("llama-3.1-8b.json", 8.030)):
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(root / name))
        assert sum(p.numel() for p in model.parameters()) / 1e9 == pytest.approx(billions, abs=0.001)


SPECULATIVE_QUICK = ["--runs", "1", "-n", "48", "--prompt-lengths", "20", "--device", "cpu"]


def test_bench_speculative_table_on_a_real_tiny_model(tiny_llama: Path) -> None:
    proc = run_cli("bench", "-m", str(tiny_llama), "--speculative", "lookup", *SPECULATIVE_QUICK)
    assert proc.returncode == 0, proc.stderr.decode()
    out = proc.stdout.decode()
    assert "--speculative lookup · greedy, ≤ 48 new tokens" in out
    # Three chat prompts through the model's chat template, greedy, the same tokens either way;
    # the copy task is too long for the tiny model's context and is reported as skipped.
    for task in ("chat: a poem", "chat: explain", "chat: advice"):
        assert f"| {task} | 48 |" in out
    assert out.count("| yes |") == 3
    assert "Skipped, too long for the model's context: copy: fix the typos" in out
    assert "| 1 (decode step) |" in out and "| 16 |" in out


def test_bench_speculative_self_draft_on_random_weights(tiny_llama: Path) -> None:
    config = str(tiny_llama / "config.json")
    random = ["--config", config, "--random-weights"]
    proc = run_cli("bench", *random, "--draft-model", "self", "--json", *SPECULATIVE_QUICK)
    assert proc.returncode == 0, proc.stderr.decode()
    report = json.loads(proc.stdout)
    assert (report["method"], report["draft"], report["random_weights"]) == ("draft", "self (int4)", True)
    [row] = report["rows"]
    assert row["task"] == "random prompt (20 tokens)" and row["tokens"] == 48
    assert row["same_tokens"] is True  # greedy: the int4 copy's drafts never change the output
    assert 0 <= row["accepted"] <= row["drafted"] and row["drafted"] > 0
    assert set(report["check_s"]) == {"2", "4", "8", "16"} and report["decode_step_s"] > 0
    other = run_cli("bench", *random, "--draft-model", config, *SPECULATIVE_QUICK)
    assert other.returncode == 2
    assert "with --random-weights the draft model can only be self" in other.stderr.decode()


def test_bench_lookup_on_random_weights_replays_the_plain_run_as_copied_text(tiny_llama: Path) -> None:
    """Random weights never repeat themselves, so lookup drafts nothing on them: the replay rows
    draft the plain run's own tokens (all right, one in ten wrong, one in four), through the same
    check passes, and the output stays the plain run's."""
    config = str(tiny_llama / "config.json")
    proc = run_cli(
        "bench", "--config", config, "--random-weights", "--speculative", "lookup", *SPECULATIVE_QUICK
    )
    assert proc.returncode == 0, proc.stderr.decode()
    out = proc.stdout.decode()
    replays = [line for line in out.splitlines() if line.startswith("| replay: the plain run's tokens")]
    assert len(replays) == 3 and all(line.endswith("| yes |") for line in replays)
    cells = [line.split(" | ") for line in replays]
    all_right, one_in_ten, one_in_four = ([int(n) for n in row[5].split(" ")[0].split("/")] for row in cells)
    assert all_right[0] == all_right[1] > 0  # every draft accepted
    assert 0 < one_in_four[0] < one_in_four[1] and one_in_ten[0] > 0
    assert "drafts pay above (acceptance per token)" in out


def test_break_even_acceptance_solves_for_the_check_cost() -> None:
    from llmcli.engine.speculative.bench import break_even_acceptance

    assert break_even_acceptance(1, 1.2) == pytest.approx(0.2)  # 1 + a = 1.2
    a = break_even_acceptance(3, 1.5)
    assert 1 + a + a**2 + a**3 == pytest.approx(1.5)
    assert break_even_acceptance(3, 4.0) == 1.0  # a pass dearer than the tokens it could make
    assert break_even_acceptance(15, 1.09) < 0.1 < break_even_acceptance(15, 3.0)


def test_bandwidth_counts_the_bytes_a_decode_step_reads() -> None:
    """A decode step reads one row of an untied input embedding and k experts of each sparse
    layer: gpt-oss-20b reads 3.6B parameters a token (its model card's active count), Llama-3.1-8B
    all but its 128256 × 4096 input table, Llama-3.2-1B (tied head) all of them."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from llmcli.engine.bench import weight_bytes_read

    root = Path(__file__).parent.parent / "configs"
    for name, billions in (("gpt-oss-20b", 3.61), ("llama-3.1-8b", 8.030 - 0.525), ("llama-3.2-1b", 1.236)):
        with torch.device("meta"):
            config = AutoConfig.from_pretrained(root / f"{name}.json")
            model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        stored = sum(p.numel() * p.element_size() for p in model.parameters())
        assert weight_bytes_read(model, stored) / 2e9 == pytest.approx(billions, abs=0.01), name


@pytest.mark.parametrize(("fast", "steps"), [("--no-fast", "eager"), ("--fast", "fixed shapes, eager")])
def test_bench_concurrency_reports_each_level_beside_one_alone(
    tiny_llama: Path, fast: str, steps: str
) -> None:
    """`--fast` on a CPU: the fixed-shape steps a GPU's graphs replay, run eagerly."""
    proc = run_cli(
        "bench", "-m", str(tiny_llama), "--concurrency", "3", "--prompt-lengths", "20", "-n", "6",
        "--runs", "2", "--device", "cpu", "--json", fast,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr.decode()
    report = json.loads(proc.stdout)
    levels = {level["sequences"]: level for level in report["levels"]}
    assert set(levels) == {1, 3}  # one alone is always measured beside the levels asked for
    for count, level in levels.items():
        assert level["kv_tokens"] == count * (20 + 6)  # each sequence's prompt and its steps
        assert level["kv_bytes"] >= level["kv_tokens"] * report["kv_bytes_per_token"]
        low, high = level["spread"]
        assert 0 < low <= level["aggregate_tok_s"] <= high
        assert level["per_sequence_tok_s"] == pytest.approx(level["aggregate_tok_s"] / count)
    assert levels[1]["versus_one"] == 1.0
    three, one = levels[3]["aggregate_tok_s"], levels[1]["aggregate_tok_s"]
    assert levels[3]["versus_one"] == pytest.approx(three / one)
    # Beside them, one sequence on the engine's own step and cache (one generation at a time).
    assert report["steps"] == steps and report["batched_eager_reason"] is None
    single = report["single_stream_tok_s"]
    assert single > 0 and report["lone_versus_single_stream"] == pytest.approx(one / single)


def test_bench_concurrency_is_refused_on_an_engine_that_decodes_one_sequence(tiny_llama: Path) -> None:
    proc = run_cli(
        "bench", "-m", str(tiny_llama), "--concurrency", "2", "--engine", "transformers", "--device", "cpu"
    )
    assert proc.returncode != 0
    assert "decodes one sequence per step" in proc.stderr.decode()


def test_the_ceiling_counts_a_gguf_files_block_layers(monkeypatch: pytest.MonkeyPatch) -> None:
    """A GGUF file read in place on the compiled kernels keeps its layers in their blocks
    (BlockLinear): the ceiling times them too, every byte they hold, and leaves nothing out."""
    from gguf_fixtures_dir import fixture
    from llmcli.config.settings import LoadSettings
    from llmcli.engine.bench import ceiling_layers, linear_ceiling
    from llmcli.models.block_linear import BlockLinear
    from llmcli.models.load import load_model
    from llmcli.models.quantized import QuantizedLinear
    from llmcli.models.resolve import resolve_model

    loaded_kernels = cpu_kernels.kernels()
    if loaded_kernels is None:
        pytest.skip("llmcli was built without its compiled kernels")
    monkeypatch.setenv(cpu_kernels.ENV, loaded_kernels.level)
    path = fixture("Q4_K_M")
    model = load_model(resolve_model(str(path)), LoadSettings(device="cpu"), lean=True).model
    linears = [m for m in model.modules() if isinstance(m, (torch.nn.Linear, QuantizedLinear, BlockLinear))]
    assert any(isinstance(m, BlockLinear) for m in linears)
    held = sum(t.numel() * t.element_size() for m in linears for t in (*m.parameters(), *m.buffers()))
    layers = ceiling_layers(model)
    assert layers.bytes == held and layers.left_out == []
    assert len(layers.calls) == len(linears)
    seconds, _ = linear_ceiling(model, runs=1)
    assert seconds > 0
