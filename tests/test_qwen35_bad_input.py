"""A Qwen3.5 checkpoint whose Gated DeltaNet layers do not match their config is refused before
anything runs, whichever engine would run it: one line on stderr naming the tensor and the
setting, a non-zero exit, no traceback — never a layer started from random values."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from cli_helpers import run_cli
from tiny_models import build_tiny_model

LAYER = "model.layers.0.linear_attn"


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("models") / "qwen3_5", "qwen3_5")


def damaged(
    folder: Path,
    into: Path,
    tensors: Callable[[dict[str, torch.Tensor]], None] = lambda _: None,
    config: Callable[[dict], None] = lambda _: None,
) -> Path:
    """A copy of `folder` with its tensors and config.json changed in place by the callables."""
    shutil.copytree(folder, into)
    weights = load_file(into / "model.safetensors")
    tensors(weights)
    save_file(weights, into / "model.safetensors", metadata={"format": "pt"})
    values = json.loads((into / "config.json").read_text())
    config(values)
    (into / "config.json").write_text(json.dumps(values))
    return into


def refusal(model: Path, *engine: str) -> str:
    proc = run_cli("generate", "-m", str(model), "-n", "1", *engine, "Hello")
    stderr = proc.stderr.decode()
    assert proc.returncode != 0 and proc.stdout == b"", stderr
    assert "Traceback" not in stderr and stderr.count("\n") == 1, stderr
    return stderr


@pytest.mark.parametrize("engine", [("--engine", "native"), ()], ids=["native", "auto"])
def test_a_missing_state_space_tensor_is_named(folder: Path, tmp_path: Path, engine: tuple[str, ...]) -> None:
    model = damaged(folder, tmp_path / "m", tensors=lambda weights: weights.pop(f"{LAYER}.A_log"))
    assert f"{LAYER}.A_log" in refusal(model, *engine)


def test_a_missing_tensor_is_refused_before_transformers_is_imported(folder: Path, tmp_path: Path) -> None:
    """Found in the files' headers: the native engine's load stops there, before any model is
    built (transformers' path would name it too, after importing itself and building one)."""
    from cli_helpers import run_reporting_imports

    model = damaged(folder, tmp_path / "m", tensors=lambda weights: weights.pop(f"{LAYER}.dt_bias"))
    result = run_reporting_imports("generate", "-m", str(model), "-n", "1", "--engine", "native", "Hello")
    assert f"{LAYER}.dt_bias" in result.stderr and "exit 1 imported -" in result.stderr, result.stderr


def test_a_convolution_width_the_config_contradicts_names_the_setting(folder: Path, tmp_path: Path) -> None:
    def narrower(weights: dict[str, torch.Tensor]) -> None:
        weights[f"{LAYER}.conv1d.weight"] = weights[f"{LAYER}.conv1d.weight"][..., 1:].contiguous()

    stderr = refusal(damaged(folder, tmp_path / "m", tensors=narrower), "--engine", "native")
    assert f"{LAYER}.conv1d.weight" in stderr and "linear_conv_kernel_dim" in stderr


@pytest.mark.parametrize(
    ("setting", "value", "tensor"),
    [
        ("linear_value_head_dim", 8, "norm.weight"),
        ("linear_num_value_heads", 2, "dt_bias"),
        ("linear_num_key_heads", 4, "in_proj_qkv.weight"),
        ("linear_conv_kernel_dim", 3, "conv1d.weight"),
    ],
)
def test_a_state_size_the_tensors_contradict_names_the_setting(
    folder: Path, tmp_path: Path, setting: str, value: int, tensor: str
) -> None:
    model = damaged(folder, tmp_path / "m", config=lambda values: values.update({setting: value}))
    stderr = refusal(model, "--engine", "native")
    assert setting in stderr and f"{LAYER}.{tensor}" in stderr, stderr


@pytest.mark.parametrize(
    ("arch", "tensor"),
    [
        ("qwen3_next", "model.layers.0.linear_attn.in_proj_ba.weight"),  # its grouped projections
        ("qwen3_5_vl", "model.language_model.layers.0.linear_attn.dt_bias"),  # under its language model
    ],
)
def test_the_other_layouts_name_a_missing_tensor_where_they_store_it(
    arch: str, tensor: str, tmp_path: Path
) -> None:
    folder = build_tiny_model(tmp_path / arch, arch)
    model = damaged(folder, tmp_path / "m", tensors=lambda weights: weights.pop(tensor))
    assert tensor in refusal(model, "--engine", "native")
