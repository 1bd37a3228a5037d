"""llmcli's Gated DeltaNet layer (engine/native/gated_deltanet.py) against transformers' own
Qwen3.5 and Qwen3-Next layers: tiny configs from their config classes, fp32, seeded random
weights scaled so the outputs are of order one (a 1e-4 tolerance then means something), and
prompts that cross the rule's 64-token chunks and end inside one."""

from __future__ import annotations

import pytest
import torch
from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet
from transformers.models.qwen3_next.configuration_qwen3_next import Qwen3NextConfig
from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet

from llmcli.engine.native.gated_deltanet import (
    CHUNK,
    DeltaNetShape,
    DeltaNetState,
    DeltaNetWeights,
    decode_step,
    prefill,
)

HIDDEN = 48
# Two value heads per key head, so the grouping of q and k heads is exercised.
SETTINGS = dict(hidden_size=HIDDEN, num_hidden_layers=2, vocab_size=64, linear_conv_kernel_dim=4)
SETTINGS.update(
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16
)
SETTINGS.update(num_attention_heads=2, num_key_value_heads=1, head_dim=16)
FAMILIES = {
    "qwen3_5": (Qwen3_5TextConfig, Qwen3_5GatedDeltaNet),
    "qwen3_next": (Qwen3NextConfig, Qwen3NextGatedDeltaNet),
}
TOLERANCE = 1e-4  # against transformers' layer
SAME = 2e-5  # llmcli against itself, the same arithmetic taken in other pieces


def reference_layer(family: str, seed: int = 0) -> torch.nn.Module:
    config_class, layer_class = FAMILIES[family]
    torch.manual_seed(seed)
    layer = layer_class(config_class(**SETTINGS), layer_idx=0).eval()
    with torch.no_grad():
        for name, tensor in layer.named_parameters():
            if name.endswith("proj_qkv.weight") or name.endswith("proj_qkvz.weight") or "proj_z" in name:
                tensor.normal_(0, HIDDEN**-0.5)
            elif "proj" in name:  # b and a spread β and the decays over their ranges; out_proj
                tensor.normal_(0, 2 * tensor.shape[-1] ** -0.5)
        layer.dt_bias.normal_(0, 1)
        # Slow decays (transformers draws rates up to 16, which forget a token by the next one),
        # so the state carries far, across chunks and pieces.
        layer.A_log.copy_(torch.empty_like(layer.A_log).uniform_(0.01, 0.5).log())
        layer.norm.weight.uniform_(0.5, 1.5)
    return layer


def shape_of(layer: torch.nn.Module) -> DeltaNetShape:
    config_class, _ = FAMILIES["qwen3_5" if isinstance(layer, Qwen3_5GatedDeltaNet) else "qwen3_next"]
    shape = DeltaNetShape.from_config(config_class(**SETTINGS))
    assert (shape.key_heads, shape.value_heads, shape.value_head_dim) == (
        layer.num_k_heads,
        layer.num_v_heads,
        layer.head_v_dim,
    )
    return shape


def ours(layer: torch.nn.Module) -> DeltaNetWeights:
    return DeltaNetWeights.from_tensors(dict(layer.named_parameters()), shape_of(layer))


def hidden_states(tokens: int, seed: int = 1) -> torch.Tensor:
    return torch.randn(tokens, HIDDEN, generator=torch.Generator().manual_seed(seed))


def fresh(weights: DeltaNetWeights) -> DeltaNetState:
    return DeltaNetState.empty(weights.shape, torch.float32, "cpu")


def biggest_difference(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("tokens", [1, 5, CHUNK, 150])
def test_prefill_matches_transformers_layer(family: str, tokens: int) -> None:
    layer = reference_layer(family)
    x = hidden_states(tokens)
    with torch.no_grad():
        expected = layer(x[None])[0]
        out, state = prefill(ours(layer), x, fresh(ours(layer)))
    assert expected.abs().mean() > 0.25, "outputs this small would make the tolerance meaningless"
    assert biggest_difference(out, expected) < TOLERANCE
    assert state.conv.shape == (1, layer.conv_dim, layer.conv_kernel_size - 1)
    assert state.recurrent.shape == (1, layer.num_v_heads, layer.head_k_dim, layer.head_v_dim)


@pytest.mark.parametrize("split", [1, 30, CHUNK, 100, 149])
def test_a_prompt_in_two_pieces_equals_it_in_one(split: int) -> None:
    weights = ours(reference_layer("qwen3_5"))
    x = hidden_states(150)
    with torch.no_grad():
        whole, whole_state = prefill(weights, x, fresh(weights))
        first, middle = prefill(weights, x[:split], fresh(weights))
        second, last = prefill(weights, x[split:], middle)
    assert biggest_difference(torch.cat((first, second)), whole) < SAME
    assert biggest_difference(last.recurrent, whole_state.recurrent) < SAME
    assert biggest_difference(last.conv, whole_state.conv) < SAME  # a GEMM rounds by its row count


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_decode_steps_after_a_prefill_match_transformers_on_the_whole_sequence(family: str) -> None:
    layer = reference_layer(family)
    weights = ours(layer)
    prompt, steps = 70, 8
    x = hidden_states(prompt + steps)
    with torch.no_grad():
        expected = layer(x[None])[0]  # causal: row t is what the layer gives after x[: t + 1]
        _, state = prefill(weights, x[:prompt], fresh(weights))
        for t in range(prompt, prompt + steps):
            out, state = decode_step(weights, x[t : t + 1], state)
            assert biggest_difference(out[0], expected[t]) < TOLERANCE, f"step {t - prompt}"


def test_decode_steps_match_transformers_through_its_own_cache() -> None:
    from transformers.cache_utils import DynamicCache

    layer = reference_layer("qwen3_5")
    weights = ours(layer)
    config = Qwen3_5TextConfig(**SETTINGS, layer_types=["linear_attention", "full_attention"])
    cache = DynamicCache(config=config)
    x = hidden_states(75)
    with torch.no_grad():
        layer(x[None, :67], cache=cache)
        _, state = prefill(weights, x[:67], fresh(weights))
        for t in range(67, 75):
            expected = layer(x[None, t : t + 1], cache=cache)[0, 0]
            out, state = decode_step(weights, x[t : t + 1], state)
            assert biggest_difference(out[0], expected) < TOLERANCE
    assert biggest_difference(state.recurrent[0], cache.layers[0].recurrent_states[0][0]) < TOLERANCE


def test_batched_decode_equals_each_sequence_decoded_alone() -> None:
    weights = ours(reference_layer("qwen3_next"))
    prompts = [hidden_states(length, seed) for length, seed in ((5, 2), (70, 3), (130, 4))]
    with torch.no_grad():
        states = [prefill(weights, prompt, fresh(weights))[1] for prompt in prompts]
        alone = [state.clone() for state in states]
        batched = DeltaNetState.stack(states)
        for step in range(4):
            tokens = hidden_states(3, seed=10 + step)
            together, batched = decode_step(weights, tokens, batched)
            for row in range(3):
                out, alone[row] = decode_step(weights, tokens[row : row + 1], alone[row])
                assert biggest_difference(together[row], out[0]) < SAME
    for row, state in enumerate(batched.unstack()):
        assert biggest_difference(state.recurrent, alone[row].recurrent) < SAME
        assert biggest_difference(state.conv, alone[row].conv) < SAME


def test_a_clone_is_a_snapshot_the_original_cannot_change() -> None:
    weights = ours(reference_layer("qwen3_5"))
    with torch.no_grad():
        _, state = prefill(weights, hidden_states(20), fresh(weights))
        snapshot = state.clone()
        kept = (state.conv.tolist(), state.recurrent.tolist())
        state.conv.add_(1.0)
        state.recurrent.mul_(2.0)
        assert (snapshot.conv.tolist(), snapshot.recurrent.tolist()) == kept
        # Nor does running on from a state write into it.
        decode_step(weights, hidden_states(1), snapshot)
        prefill(weights, hidden_states(3), snapshot)
    assert (snapshot.conv.tolist(), snapshot.recurrent.tolist()) == kept


def test_a_state_measures_its_bytes() -> None:
    weights = ours(reference_layer("qwen3_5"))
    state = DeltaNetState.empty(weights.shape, torch.bfloat16, "cpu")
    shape = weights.shape
    conv = shape.conv_dim * (shape.conv_kernel - 1) * 2
    recurrent = shape.value_heads * shape.key_head_dim * shape.value_head_dim * 4
    assert state.nbytes == conv + recurrent
    assert DeltaNetState.stack([state, state]).nbytes == 2 * (conv + recurrent)


def test_a_missing_or_contradicting_tensor_is_named() -> None:
    layer = reference_layer("qwen3_5")
    shape = shape_of(layer)
    tensors = dict(layer.named_parameters())
    with pytest.raises(ValueError, match="missing tensor A_log"):
        DeltaNetWeights.from_tensors({k: v for k, v in tensors.items() if k != "A_log"}, shape)
    wider = DeltaNetShape(**{**shape.__dict__, "conv_kernel": 5})
    with pytest.raises(ValueError, match=r"conv1d\.weight"):
        DeltaNetWeights.from_tensors(tensors, wider)
    with pytest.raises(ValueError, match=r"conv1d\.bias"):
        DeltaNetWeights.from_tensors({**tensors, "conv1d.bias": torch.zeros(layer.conv_dim)}, shape)


def test_a_qwen3_next_layer_the_config_contradicts_is_named() -> None:
    layer = reference_layer("qwen3_next")
    shape = shape_of(layer)
    more_heads = DeltaNetShape(**{**shape.__dict__, "value_heads": 2 * shape.value_heads})
    with pytest.raises(ValueError, match=r"in_proj_qkvz\.weight"):
        DeltaNetWeights.from_tensors(dict(layer.named_parameters()), more_heads)


def test_in_bf16_the_rule_runs_in_fp32_as_transformers_runs_it() -> None:
    """bf16 weights: the rule and its state in fp32, the convolution and the norm in bf16, so
    prefill and decode round as transformers' layer does (a rule run in bf16 would be ~0.1 off)."""
    from transformers.cache_utils import DynamicCache

    layer = reference_layer("qwen3_5").to(torch.bfloat16)
    weights = DeltaNetWeights.from_tensors(dict(layer.named_parameters()), shape_of(layer))
    config = Qwen3_5TextConfig(**SETTINGS, layer_types=["linear_attention", "full_attention"])
    cache = DynamicCache(config=config)
    x = hidden_states(70).to(torch.bfloat16)
    with torch.no_grad():
        expected = layer(x[None, :67], cache=cache)[0]
        out, state = prefill(weights, x[:67], DeltaNetState.empty(weights.shape, torch.bfloat16, "cpu"))
        assert biggest_difference(out.float(), expected.float()) < 1e-2
        for t in range(67, 70):
            expected = layer(x[None, t : t + 1], cache=cache)[0, 0]
            out, state = decode_step(weights, x[t : t + 1], state)
            assert biggest_difference(out[0].float(), expected.float()) < 1e-2
    assert (state.conv.dtype, state.recurrent.dtype) == (torch.bfloat16, torch.float32)
