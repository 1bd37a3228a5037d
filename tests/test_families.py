"""The model families beyond Llama's as a user meets them: picked by --engine auto, the same
greedy text as transformers' forward, and a checkpoint that does not match its config (a missing
expert, a tensor of the wrong shape) refused in one line naming the tensor."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from cli_helpers import one_error_line, run_cli, run_reporting_imports
from tiny_models import build_tiny_model, mxfp4_experts


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny-moe", "qwen3_moe")


def generated(model: Path, *extra: str) -> dict:
    proc = run_cli(
        "generate", "-m", str(model), "--device", "cpu", "-t", "0", "-n", "24", "--json", *extra, "Hi"
    )
    assert proc.returncode == 0, proc.stderr.decode()
    return json.loads(proc.stdout)


def test_a_mixture_of_experts_runs_native_and_says_what_transformers_says(tiny_moe: Path) -> None:
    native, reference = generated(tiny_moe), generated(tiny_moe, "--engine", "transformers")
    assert (native["engine"], reference["engine"]) == ("native", "transformers")
    assert native["text"] == reference["text"] and native["completion_tokens"] == 24


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_gpt_oss_mxfp4_experts_load_dequantized_with_a_note_and_run_native(
    dtype: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """The released gpt-oss checkpoints store experts in MXFP4. Without a kernel (a CPU here)
    llmcli's lean loader dequantizes them, as transformers' path does, and says so in one line
    (their memory grows 4-8x); it imports neither transformers nor accelerate, reports the
    weights as unquantized, and runs them on its own forward: the same greedy text as
    transformers', which says the same of its own dequantization."""
    folder = mxfp4_experts(build_tiny_model(tmp_path_factory.mktemp("models") / "tiny-mxfp4", "gpt_oss"))
    args = ["generate", "-m", str(folder), "--device", "cpu", "--dtype", dtype, "-t", "0", "-n", "24"]
    args.append("--json")
    lean = run_reporting_imports(*args, "Hi")
    assert [line for line in lean.stderr.splitlines() if line] == [
        f"MXFP4 experts dequantized to {dtype}: llmcli has no MXFP4 kernel on cpu, "
        "so they take 4-8x their size on disk in memory",
        "exit 0 imported -",
    ]
    native = json.loads(lean.stdout)
    proc = run_cli(*args, "--engine", "transformers", "Hi")
    assert proc.returncode == 0, proc.stderr.decode()
    assert proc.stderr.decode().strip().splitlines() == [
        f"MXFP4 experts dequantized to {dtype}: transformers has no MXFP4 kernel on cpu here, "
        "so they take 4-8x their size on disk in memory"
    ]
    reference = json.loads(proc.stdout)
    assert (native["engine"], native["quant"]) == ("native", "none")
    assert native["text"] == reference["text"] and len(set(native["text"])) > 5


def test_experts_left_in_mxfp4_blocks_are_refused_by_the_native_engine() -> None:
    """Where transformers keeps them packed (a GPU with its kernel), the native engine does not
    read them: --engine auto falls back, and native says why."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from llmcli.engine.native.families import NotSupported, check_supported

    config = AutoConfig.for_model(
        "gpt_oss", hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, num_local_experts=4, vocab_size=128,
    )  # fmt: skip
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    experts = model.model.layers[1].mlp.experts
    experts.gate_up_proj = torch.nn.Parameter(torch.zeros(4, 128, 32, dtype=torch.uint8), requires_grad=False)
    with pytest.raises(NotSupported, match="layer 1's experts are not dequantized tensors"):
        check_supported(model, 64)


def test_stacked_experts_are_quantized_on_a_cpu_and_refused_where_they_would_be_skipped(
    tiny_moe: Path,
) -> None:
    """llmcli's int8/int4 quantize each expert (the bulk of an MoE's weights) on a CPU, as
    `models show` estimated; bitsandbytes (--engine transformers) would leave them unquantized,
    and a GPU has no gathered kernel for them yet: both refused in one line, never skipped."""
    full = generated(tiny_moe)
    int8, int4 = generated(tiny_moe, "--quant", "int8"), generated(tiny_moe, "--quant", "int4")
    assert (int8["engine"], int8["quant"], int4["engine"], int4["quant"]) == (
        "native",
        "int8",
        "native",
        "int4-g64",
    )
    assert int8["weight_bytes"] < full["weight_bytes"] / 3 and int4["weight_bytes"] < int8["weight_bytes"]
    shown = re.search(r"int8 ([0-9.]+) kB", run_cli("models", "show", str(tiny_moe)).stdout.decode())
    assert shown and abs(float(shown.group(1)) * 1000 - int8["weight_bytes"]) < 0.01 * int8["weight_bytes"]
    proc = run_cli(
        "generate",
        "-m",
        str(tiny_moe),
        "--device",
        "cpu",
        "--quant",
        "int4",
        "--engine",
        "transformers",
        "hi",
    )
    assert "keeps its experts in stacked tensors, which bitsandbytes does not quantize" in one_error_line(
        proc, 2
    )


def test_quantized_experts_on_a_gpu_are_refused_before_loading() -> None:
    from llmcli.errors import UsageError
    from llmcli.models.quant import native_quant_kind

    config = {"architectures": ["Qwen3MoeForCausalLM"]}
    assert native_quant_kind("int4", "auto", False, "cpu", config) == "int4"
    with pytest.raises(UsageError, match="quantized for a CPU only so far"):
        native_quant_kind("int4", "auto", False, "cuda", config)


def without(source: Path, folder: Path, drop: str | None = None, reshape: str | None = None) -> Path:
    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(source, folder)
    tensors = load_file(folder / "model.safetensors")
    if drop:
        del tensors[drop]
    if reshape:
        tensors[reshape] = torch.zeros(3, 3)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


@pytest.mark.parametrize(
    ("drop", "reshape", "message"),
    [
        (
            "model.layers.1.mlp.experts.2.up_proj.weight",
            None,
            "lacks the tensor model.layers.1.mlp.experts.2.up_proj",
        ),
        (
            "model.layers.0.self_attn.k_proj.weight",
            None,
            "lacks the tensor model.layers.0.self_attn.k_proj.weight",
        ),
        (
            None,
            "model.layers.1.self_attn.o_proj.weight",
            "tensor model.layers.1.self_attn.o_proj.weight has the shape",
        ),
        (
            None,
            "model.layers.1.mlp.experts.2.up_proj.weight",
            "tensor model.layers.1.mlp.experts.2.up_proj.weight has the shape [3, 3], where expert 0's has",
        ),
    ],
)
def test_a_checkpoint_that_does_not_match_its_config_is_named(
    tiny_moe: Path, tmp_path: Path, drop: str | None, reshape: str | None, message: str
) -> None:
    broken = without(tiny_moe, tmp_path / "broken", drop, reshape)
    proc = run_cli("generate", "-m", str(broken), "--device", "cpu", "-n", "2", "hi")
    assert message in one_error_line(proc, 1)
