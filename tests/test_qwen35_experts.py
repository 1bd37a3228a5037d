"""Qwen3.5-MoE and Qwen3-Next on the native engine where --engine native asks for them: their
Gated DeltaNet and gated-attention layers as the dense Qwen3.5's (Qwen3-Next's input projections
fused, their rows grouped per key head), each sparse layer's feed-forward a router's experts
beside a shared expert scaled by its sigmoid gate. Held to transformers' own model by the dense
model's checks, run here on each model's folder (they take the fixtures below): logits within
1e-4 in fp32 after a prefill and at every decode step, greedy tokens equal to `generate`, a
speculative check and a second chat turn as the decode steps give them, and `generate --engine
native` replying as transformers does, without importing it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from test_qwen35 import (  # noqa: F401  (collected here, on this module's fixtures)
    load,
    test_a_second_turn_from_the_first_turns_cache_equals_the_conversation_prefilled_fresh,
    test_a_speculative_check_gives_each_row_what_its_decode_step_would,
    test_generate_on_the_native_engine_imports_no_transformers_and_replies_as_transformers,
    test_greedy_tokens_equal_transformers_generate,
    test_prefill_and_every_decode_step_match_transformers,
)

from tiny_models import build_tiny_model

ARCHITECTURES = {
    "qwen3_5_moe": "Qwen3_5MoeForCausalLM",
    # Its experts stored stacked, as transformers 5 holds them and Qwen3.5-MoE's release stores them.
    "qwen3_5_moe_stacked": "Qwen3_5MoeForCausalLM",
    "qwen3_next": "Qwen3NextForCausalLM",
}


@pytest.fixture(scope="module", params=sorted(ARCHITECTURES))
def folder(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    arch = request.param.removesuffix("_stacked")
    built = build_tiny_model(tmp_path_factory.mktemp("models") / request.param, arch)
    if request.param.endswith("_stacked"):
        stack_experts(built / "model.safetensors")
    return built


def stack_experts(path: Path) -> None:
    """Each layer's per-expert gate/up/down tensors as one `experts.gate_up_proj` [experts, 2 ×
    intermediate, hidden] and one `experts.down_proj` [experts, hidden, intermediate]."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(path)
    blocks = sorted({name.split(".experts.")[0] for name in tensors if ".experts.0." in name})
    for block in blocks:
        count = sum(1 for name in tensors if name.startswith(f"{block}.experts.") and "down_proj" in name)
        experts = [
            {part: tensors.pop(f"{block}.experts.{i}.{part}_proj.weight") for part in ("gate", "up", "down")}
            for i in range(count)
        ]
        tensors[f"{block}.experts.gate_up_proj"] = torch.stack(
            [torch.cat((e["gate"], e["up"])) for e in experts]
        )
        tensors[f"{block}.experts.down_proj"] = torch.stack([e["down"] for e in experts])
    save_file(tensors, path, metadata={"format": "pt"})


@pytest.fixture(scope="module")
def reference(folder: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def loaded(folder: Path):
    return load(folder, "native")


def test_the_lean_loader_builds_its_experts_and_shared_expert(folder: Path, loaded) -> None:
    from llmcli.engine.native.families.shared_expert import SharedExpertMoE
    from llmcli.engine.native.forward import Transformer

    assert loaded.model.architecture == ARCHITECTURES[folder.name]
    sparse = [
        isinstance(block.feed_forward, SharedExpertMoE) for block in Transformer(loaded.model, 64).blocks
    ]
    # Qwen3-Next's first layer is one of its `mlp_only_layers`: a dense MLP.
    assert sparse == ([False, True] if folder.name == "qwen3_next" else [True, True])


def test_models_show_says_which_engine_runs_it_and_why(folder: Path, tiny_llama: Path) -> None:
    from cli_helpers import run_cli

    proc = run_cli("models", "show", str(folder), "--json")
    assert proc.returncode == 0, proc.stderr.decode()
    shown = json.loads(proc.stdout)["engine"]
    why = f"the native engine runs {ARCHITECTURES[folder.name]} (Qwen3.5 and Qwen3-Next)"
    assert shown == {"auto": "native", "why": why}
    llama = json.loads(run_cli("models", "show", str(tiny_llama), "--json").stdout)["engine"]
    assert llama["auto"] == "native" and "Llama" in llama["why"]
    text = run_cli("models", "show", str(folder)).stdout.decode()
    assert "engine         native under --engine auto (the native engine runs Qwen3" in text
