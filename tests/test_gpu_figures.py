"""scripts/gpu_figures.sh's lease run, dry on this CPU (FIGURES_DEVICE=cpu, a tiny Llama config
for both the 1B and the 8B), and scripts/gpu_table.py read on what its steps really printed: the
table a lent GPU's run ends with must read every step's output, and say why where a step did not
run, failed, was skipped or was cut off — before a lease is spent finding out it does not."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_figures.sh"
TABLE = ROOT / "scripts" / "gpu_table.py"
# The cheap steps, the 8B ones on the same tiny config; ceiling-8b-bf16 and first-token-8b left
# out (their rows must then say they did not run), streams-8b run apart on a config that is not
# there (its row: it failed).
STEPS = [
    "card",
    "ceiling-1b-bf16",
    "ceiling-8b-int4",
    "streams-1b",
    "kquant-gemv",
    "kquant-decode",
    "spec-8b-lookup",
    "first-token-1b",
    "gpu-tests",
]


# A Llama of K-quant-friendly widths (multiples of 256), two layers: seconds a step.
TINY_LLAMA = {"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2, "vocab_size": 512}
TINY_HEADS = {"num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64}


def tiny_config(path: Path) -> Path:
    from transformers import LlamaConfig

    shape = TINY_LLAMA | TINY_HEADS | {"max_position_embeddings": 1024, "tie_word_embeddings": True}
    LlamaConfig(**shape, architectures=["LlamaForCausalLM"]).to_json_file(path)
    return path


# pytest's step on a folder of its own: one GPU-marked test that passes, one that fails, and a
# file that does not collect (a package the GPU image lacks).
MARKED = """import pytest

pytestmark = pytest.mark.gpu


def test_passes():
    pass


def test_fails():
    assert False
"""


def figures(out: Path, steps: list[str], **env: str) -> subprocess.CompletedProcess[str]:
    settings = {
        "PYTHON": sys.executable,
        "FIGURES_DEVICE": "cpu",
        "FIGURES_TOKENS": "16",
        "LEASE_RUNS": "1",
        "FIGURES_KQUANT_TYPES": "Q4_K",  # under Triton's interpreter where the kernels exist
        "FIGURES_KQUANT_SHAPES": "attn_k,output",
        "FIGURES_SCRATCH": str(out.parent / "scratch"),
    }
    return subprocess.run(
        ["bash", str(SCRIPT), str(out), *steps],
        env={**os.environ, **settings, **env},
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )


def table_rows(out: Path) -> dict[str, tuple[str, str, str]]:
    """gpu_table.py's rows: target → (measured, ratio, met?)."""
    text = subprocess.run(
        [sys.executable, str(TABLE), str(out)], capture_output=True, text=True, check=True
    ).stdout
    rows = {}
    for line in text.splitlines():
        cells = [cell.strip() for cell in line.strip("|").split(" | ")]
        if line.startswith("| ") and len(cells) == 4 and cells[0] != "target":
            rows[cells[0]] = (cells[1], cells[2], cells[3])
    return rows


def output(out: Path, step: str) -> dict:
    return json.loads((out / f"{step}.out").read_text().splitlines()[-1])


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("figures")
    config = tiny_config(folder / "tiny.json")
    out = folder / "out"
    archive = folder / "figures.tgz"
    tests = folder / "marked"
    tests.mkdir()
    (tests / "test_marked.py").write_text(MARKED)
    (tests / "test_uncollected.py").write_text("import a_package_not_there\n")
    tiny = {"FIGURES_1B": str(config), "FIGURES_8B": str(config), "FIGURES_ARCHIVE": str(archive)}
    tiny["FIGURES_TESTS"] = str(tests)
    printed = figures(out, STEPS, **tiny).stdout
    assert "| target | measured | ratio | met? |" in printed  # the run ends with the table
    figures(out, ["streams-8b"], **tiny | {"FIGURES_8B": str(folder / "missing.json")})
    return out


def test_the_targets_measured_on_the_cpu_read_from_their_steps_own_output(run: Path) -> None:
    rows = table_rows(run)
    ceiling = output(run, "ceiling-1b-bf16")
    assert rows["1B bf16 batch 1 ≥ 85 % of its linear-layers ceiling"][1] == f"{ceiling['ceiling_pct']:.1f} %"
    streams = {level["sequences"]: level for level in output(run, "streams-1b")["levels"]}
    measured, ratio, met = rows["1B bf16, 8 streams ≥ 5× one stream"]
    assert ratio == f"{streams[8]['versus_one']:.2f}×"
    assert met == ("met" if streams[8]["versus_one"] >= 5 else "**missed**")
    # against the single-stream graph measured in the same bench run, not another step's decode
    lone = streams[1]["aggregate_tok_s"] / output(run, "streams-1b")["single_stream_tok_s"]
    assert rows["1B bf16: a lone stream within 3 % of the single-stream graph"][1] == f"{lone:.2f}×"
    # random weights repeat nothing: the copy-heavy stand-in is the replayed drafts, 1 in 10 wrong
    (speculative,) = [row for row in output(run, "spec-8b-lookup")["rows"] if "1 in 10 wrong" in row["task"]]
    measured, ratio, _ = rows[
        "speculative (lookup, copy-heavy prompt) ≥ 1.5× plain decode on the 8B, same text"
    ]
    assert ratio == f"{speculative['speedup']:.2f}×"
    assert "copy-heavy stand-in" in measured
    file, int4 = output(run, "kquant-decode"), output(run, "ceiling-8b-int4")
    measured, ratio, _ = rows["a Q4_K_M file's decode ≥ 0.9× the same model's int4 (8B)"]
    assert ratio == f"{file['decode_tok_s'] / int4['decode_tok_s']:.2f}×"
    assert file["model"] == "random-q4_k_m" and not (run.parent / "scratch" / "random-q4_k_m.gguf").exists()
    first = output(run, "first-token-1b")
    measured, ratio, _ = rows["one-shot first token from the page cache, 1B ≤ 4 s"]
    assert ratio == f"{first['first_byte_s']:.2f} s"
    assert "import torch" in measured and "load" in measured and "first token" in measured


def test_what_was_not_measured_says_why(run: Path) -> None:
    rows = table_rows(run)
    failed = rows["8B bf16, 16 streams ≥ 8× one stream"][0]
    last_error = (run / "streams-8b.err").read_text().strip().splitlines()[-1].strip()
    assert failed.startswith("not measured: streams-8b failed (exit ") and last_error[:100] in failed
    measured, _, met = rows["one-shot first token from the page cache, 8B ≤ 8 s"]
    assert measured.startswith("not measured: first-token-8b did not run") and met == "—"
    lone = rows["8B bf16: a lone stream within 3 % of the single-stream graph"][0]
    assert lone.startswith("not measured: streams-8b failed")
    kquant = output(run, "kquant-gemv")
    if kquant["status"] == "not built":
        assert "not built" in rows["K-quant GEMV ≥ 70 % of copy bandwidth on 8B shapes"][0]
    else:  # the kernels are in this checkout: Triton's interpreter ran them
        share = kquant["types"]["Q4_K"]["pct_of_bandwidth"]
        assert rows["K-quant GEMV ≥ 70 % of copy bandwidth on 8B shapes (Q4_K)"][1] == f"{share:.1f} %"
    measured, ratio, met = rows["pytest -m gpu: every test passes"]
    assert measured == "1 passed, 1 failed; did not collect: test_uncollected.py"
    assert (ratio, met) == ("1 failed", "**missed**")


def test_the_card_is_named_and_a_cut_lease_keeps_its_table(run: Path, tmp_path: Path) -> None:
    table = subprocess.run([sys.executable, str(TABLE), str(run)], capture_output=True, text=True).stdout
    assert table.startswith("Card: CPU")
    with tarfile.open(run.parent / "figures.tgz") as archive:  # rewritten after every step
        assert "./table.md" in archive.getnames()
    cut = tmp_path / "cut"
    cut.mkdir()
    for path in run.iterdir():
        if path.name != "first-token-1b.rc":  # the lease ended while first-token-1b ran
            (cut / path.name).write_bytes(path.read_bytes())
    rows = table_rows(cut)
    assert "first-token-1b was cut off" in rows["one-shot first token from the page cache, 1B ≤ 4 s"][0]


def test_a_spent_budget_skips_the_steps_and_says_so(tmp_path: Path) -> None:
    out = tmp_path / "out"
    figures(out, ["lease"], FIGURES_SECONDS="1")
    rows = table_rows(out)
    assert all("skipped: the run's time budget was spent" in measured for measured, _, _ in rows.values())


def test_the_lease_tests_no_gpu_has_run_first(tmp_path: Path) -> None:
    """The pytest step's order, read from pytest itself collecting (a python that adds
    --collect-only: running the suite is not this test's job): the new GPU-marked tests, then the
    kernel tests, then the GPU-marked rest with test_gpu.py and test_quant.py, which an H100 ran
    before, first among them — a cut at the time box loses the least that no GPU has shown."""
    collecting = tmp_path / "python"
    collecting.write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@" --collect-only -qq\n')
    collecting.chmod(0o755)
    out = tmp_path / "out"
    figures(out, ["gpu-tests"], PYTHON=str(collecting), FIGURES_TESTS="")
    tests = [line for line in (out / "gpu-tests.out").read_text().splitlines() if "::" in line]
    names = [Path(file).name for file in dict.fromkeys(test.split("::")[0] for test in tests)]
    new_gpu = {"test_gpu_batched.py", "test_gpu_gguf.py", "test_gpu_paged_serve.py"}
    new_gpu.add("test_speculative_schedule.py")
    kernels = {"test_gguf_cuda.py", "test_triton_kernels.py"}
    first_old = names.index("test_gpu.py")
    assert new_gpu | kernels <= set(names[:first_old])
    assert names.index("test_gpu.py") < names.index("test_quant.py")
    assert max(names.index(name) for name in new_gpu) < min(names.index(name) for name in kernels)
    assert len(tests) == len(set(tests))  # no test twice: each run leaves out the ones before
