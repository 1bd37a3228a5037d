"""The native forward against transformers' own model code, for every architecture it claims.

Each config is tiny and built in memory with random weights, in fp32: logits must agree within
1e-4 after a prefill and at every decode step, and 64 greedy tokens must be identical to
`model.generate`. Architectures it does not claim are left to transformers, never run wrong.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from llmcli.config.settings import SamplingParams
from llmcli.engine.loop import Engine
from llmcli.engine.native.backend import NativeBackend
from llmcli.engine.native.families import NotSupported, check_supported
from llmcli.engine.native.plans import PooledRows
from llmcli.errors import LlmcliError

VOCAB = 256
CONTEXT = 512
BASE = {
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": CONTEXT,
    "initializer_range": 0.2,  # peaked logits, not near-ties
}
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}
MOE = {"moe_intermediate_size": 48, "norm_topk_prob": True}
TIED = {"tie_word_embeddings": True}
PHI = {"eos_token_id": 1, "pad_token_id": 0, "tie_word_embeddings": True}
# Gemma 3: layers 0-2 sliding, 3 global (a pattern of 4), head_dim 24 ≠ 64/4, its own scalar;
# untied, since a tied output matrix reads back the scaled input embedding and only repeats it.
GEMMA = {
    "num_hidden_layers": 4, "sliding_window_pattern": 4, "head_dim": 24, "query_pre_attn_scalar": 20,
    "eos_token_id": 1, "pad_token_id": 0, "bos_token_id": 2, "tie_word_embeddings": False,
}  # fmt: skip
# gpt-oss: sliding (window 8) and full layers alternating, sinks, biased experts; yarn RoPE.
GPT_OSS = {
    "num_hidden_layers": 4, "num_local_experts": 4, "num_experts_per_tok": 2, "head_dim": 16,
    "intermediate_size": 48, "sliding_window": 8, "eos_token_id": 1, "pad_token_id": 0,
    "layer_types": ["sliding_attention", "full_attention"] * 2,
    "rope_parameters": {
        "rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
        "original_max_position_embeddings": 128, "truncate": False,
    },
}  # fmt: skip
CASES = {
    "llama-gqa2": ("llama", {}),
    "llama-mha-gqa1": ("llama", {"num_key_value_heads": 4}),
    "llama-gqa4": ("llama", {"num_key_value_heads": 1}),
    "llama-tied": ("llama", {"tie_word_embeddings": True}),
    "llama3-rope-scaling": ("llama", {"rope_parameters": LLAMA3_ROPE}),
    "llama-head-dim-32": ("llama", {"head_dim": 32}),
    "llama-attention-and-mlp-bias": ("llama", {"attention_bias": True, "mlp_bias": True}),
    "mistral": ("mistral", {"sliding_window": None}),
    "mistral-window-16": ("mistral", {"sliding_window": 16}),  # every layer slides (v0.1)
    "qwen2-bias": ("qwen2", {"tie_word_embeddings": False}),
    "qwen2-tied": ("qwen2", {"tie_word_embeddings": True}),
    "qwen3-qk-norm": ("qwen3", {"head_dim": 24, "tie_word_embeddings": True}),
    "qwen3-untied-gqa4": ("qwen3", {"num_key_value_heads": 1, "tie_word_embeddings": False}),
    "phi3-fused": ("phi3", {"eos_token_id": 1, "pad_token_id": 0}),
    "phi4-mini-partial-rotary": (
        "phi3",
        {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.75}} | PHI,
    ),
    "gemma3-window-8-shorter-than-the-prompt": ("gemma3_text", {"sliding_window": 8, **GEMMA}),
    "gemma3-window-longer-than-the-prompt-mha": (
        "gemma3_text",
        {"sliding_window": 256, "num_key_value_heads": 4, "sliding_window_pattern": 2, **GEMMA},
    ),
    # Gemma 2: sliding and global layers alternating, scores and logits soft-capped; caps low
    # enough that the random logits (~±8) and scores reach into tanh's curve.
    "gemma2-window-8-softcapped": (
        "gemma2",
        {"sliding_window": 8, "attn_logit_softcapping": 2.0, "final_logit_softcapping": 5.0, **GEMMA},
    ),
    "qwen3-moe-k2": ("qwen3_moe", {"num_experts": 4, "num_experts_per_tok": 2, **MOE}),
    "qwen3-moe-k1-dense-layer-unnormalised": (
        "qwen3_moe",
        # MOE first: its norm_topk_prob=True placed after overrode this case's False.
        {**MOE, "num_experts": 8, "num_experts_per_tok": 1, "norm_topk_prob": False, "mlp_only_layers": [0]},
    ),
    "qwen3-moe-k8-head-dim-24": (
        "qwen3_moe",
        {"num_experts": 8, "num_experts_per_tok": 8, "head_dim": 24, "num_key_value_heads": 1, **MOE},
    ),
    "gpt-oss-k2-window-8": ("gpt_oss", GPT_OSS),
    "gpt-oss-k1-mha-tied": (
        "gpt_oss",
        {**GPT_OSS, "num_experts_per_tok": 1, "num_key_value_heads": 4, "tie_word_embeddings": True},
    ),
    "mixtral-k2-tied": (
        "mixtral",
        {"num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": None, **TIED},
    ),
}


def build(arch: str, overrides: dict) -> torch.nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(arch, **{**BASE, **overrides})
    torch.manual_seed(0)
    # transformers has no SDPA path with sinks (gpt-oss) or soft-capping (Gemma 2)
    attention = "eager" if arch in ("gpt_oss", "gemma2") else "sdpa"
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation=attention)
    if arch == "qwen2":  # transformers initialises biases to zero: make them count
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.5)
    if arch == "gpt_oss":  # biases start at zero, sinks small: make them count
        with torch.no_grad():
            for name, parameter in model.named_parameters():
                if name.endswith(("bias", "sinks")):
                    parameter.normal_(0, 0.5)
    if arch in ("gemma3_text", "gemma2"):  # Gemma's norms start at zero (a scale of 1 + 0): make them count
        with torch.no_grad():
            for name, parameter in model.named_parameters():
                if "norm" in name:
                    parameter.normal_(0, 0.5)
    return model.eval()


@pytest.fixture(scope="module", params=list(CASES))
def model(request: pytest.FixtureRequest) -> torch.nn.Module:
    arch, overrides = CASES[request.param]
    return build(arch, overrides)


def prompt(length: int, seed: int = 0) -> list[int]:
    return torch.randint(0, VOCAB, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


@torch.inference_mode()
def test_prefill_and_every_decode_step_match_transformers(model) -> None:
    check_supported(model, CONTEXT)
    native = NativeBackend(model, CONTEXT)
    ids = prompt(37)
    logits = native.prefill(ids[:30])
    reference = model(torch.tensor([ids])).logits[0].float()
    torch.testing.assert_close(logits[0], reference[29], rtol=0, atol=1e-4)
    for i in range(30, 37):  # decode steps feed the prompt's own next tokens
        logits = native.decode(torch.tensor([ids[i]]))
        torch.testing.assert_close(logits[0], reference[i], rtol=0, atol=1e-4)
    # A second chunk after cached tokens (a chat turn) uses the chunked causal mask.
    native.crop(20)
    logits = native.prefill(ids[20:37])
    torch.testing.assert_close(logits[0], reference[36], rtol=0, atol=1e-4)


@pytest.mark.parametrize("static_shapes", [False, True], ids=["exact", "bucketed"])
@torch.inference_mode()
def test_64_greedy_tokens_equal_model_generate(model, static_shapes: bool) -> None:
    ids = prompt(12, seed=1)
    engine = Engine(NativeBackend(model, CONTEXT, static_shapes=static_shapes), frozenset(), CONTEXT)
    generation = engine.generate(ids, SamplingParams(temperature=0.0, max_new_tokens=64), None)
    list(generation)
    expected = model.generate(
        torch.tensor([ids]),
        attention_mask=torch.ones(1, len(ids), dtype=torch.long),
        do_sample=False,
        max_new_tokens=64,
        min_new_tokens=64,
        eos_token_id=None,
        pad_token_id=0,
    )[0, len(ids) :].tolist()
    assert generation.result.token_ids == expected
    assert len(set(expected)) > 5  # not a degenerate repetition that any bug would also produce


def test_native_engine_shares_the_weights_transformers_loaded() -> None:
    model = build("qwen2", {})
    before = sum(p.numel() for p in model.parameters())
    backend = NativeBackend(model, CONTEXT)
    attention = model.model.layers[0].self_attn
    fused = backend.net.blocks[0].attention.qkv.keywords["weight"]
    # q/k/v are views of the fused matrix: one copy of the weights, and transformers still works.
    assert attention.q_proj.weight.data_ptr() == fused.data_ptr()
    assert attention.k_proj.weight.untyped_storage().data_ptr() == fused.untyped_storage().data_ptr()
    assert sum(p.numel() for p in model.parameters()) == before
    again = NativeBackend(model, CONTEXT).net.blocks[0].attention.qkv.keywords["weight"]
    assert again is fused  # fused once only


@pytest.mark.parametrize(
    ("arch", "overrides", "reason"),
    [
        ("gemma3_text", {"hidden_activation": "gelu", **GEMMA}, "activation 'gelu'"),
        ("llama", {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}}, "RoPE"),
        ("gpt2", {"n_embd": 64, "n_layer": 1, "n_head": 2, "vocab_size": VOCAB}, "not in a family"),
    ],
)
def test_what_the_native_engine_does_not_claim_is_refused(arch: str, overrides: dict, reason: str) -> None:
    model = build(arch, {} if arch == "gpt2" else overrides) if arch != "gpt2" else _gpt2(overrides)
    with pytest.raises(NotSupported, match=reason):
        check_supported(model, CONTEXT)


def _gpt2(overrides: dict) -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config(**overrides)).eval()


def test_engine_auto_falls_back_to_transformers_and_native_refuses(loaded_tiny) -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    other = dataclasses.replace(
        loaded_tiny, model=GPT2LMHeadModel(GPT2Config(n_embd=64, n_layer=1, n_head=2)).eval(), engine="auto"
    )
    assert Engine.for_loaded(other).name == "transformers"
    assert Engine.for_loaded(dataclasses.replace(loaded_tiny, engine="auto")).name == "native"
    with pytest.raises(LlmcliError, match="--engine native cannot run"):
        Engine.for_loaded(dataclasses.replace(other, engine="native"))


@torch.inference_mode()
def test_a_prompt_longer_than_a_prefill_chunk_equals_one_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    from llmcli.engine.native import backend

    model = build("llama", {})
    ids = prompt(150, seed=2)
    whole = NativeBackend(model, CONTEXT).prefill(ids)
    monkeypatch.setattr(backend, "PREFILL_CHUNK", 64)
    chunked = NativeBackend(model, CONTEXT)
    torch.testing.assert_close(chunked.prefill(ids), whole, rtol=0, atol=1e-4)
    assert chunked.length == 150


@pytest.mark.parametrize("case", ["llama-gqa2", "gpt-oss-k2-window-8", "gemma2-window-8-softcapped"])
@torch.inference_mode()
def test_decode_attention_split_along_the_keys_matches_transformers(
    monkeypatch: pytest.MonkeyPatch, case: str
) -> None:
    """Long buckets (≥ 2048 slots on a GPU) split attention along the keys; lowered thresholds
    run that path here over 512 slots in chunks of 64, every later slot masked (gpt-oss: its
    full layers' sinks join that softmax; Gemma 2: its scores capped before it)."""
    from llmcli.engine.native import attention

    monkeypatch.setattr(attention, "SPLIT_ATTENTION_FROM", 256)
    monkeypatch.setattr(attention, "SPLIT_CHUNK", 64)
    model = build(*CASES[case])
    ids = prompt(300, seed=3)
    native = NativeBackend(model, CONTEXT, static_shapes=True)
    native.prefill(ids[:290])
    reference = model(torch.tensor([ids])).logits[0].float()
    for i in range(290, 300):
        logits = native.decode(torch.tensor([ids[i]]))
        torch.testing.assert_close(logits[0], reference[i], rtol=0, atol=1e-4)


def test_engine_setting_from_flag_env_and_config(tiny_llama, tmp_path, monkeypatch) -> None:
    import json

    from cli_helpers import run_cli

    args = ["generate", "-m", str(tiny_llama), "-t", "0", "-n", "8", "--json", "Hello"]
    native = run_cli(*args)
    assert native.returncode == 0, native.stderr.decode()
    assert json.loads(native.stdout)["engine"] == "native"
    via_flag = run_cli(*args, "--engine", "transformers")
    assert json.loads(via_flag.stdout)["engine"] == "transformers"
    assert json.loads(via_flag.stdout)["text"] == json.loads(native.stdout)["text"]

    def engine_in_force(*flags: str) -> tuple[str, str]:  # the layers, as every command reads them
        shown = json.loads(run_cli("config", "show", "--json", *flags).stdout)["engine"]
        return shown["value"], shown["source"]

    monkeypatch.setenv("LLMCLI_ENGINE", "transformers")
    assert engine_in_force() == ("transformers", "env")
    monkeypatch.delenv("LLMCLI_ENGINE")
    config = tmp_path / "config.toml"
    config.write_text('[defaults]\nengine = "transformers"\n')
    monkeypatch.setenv("LLMCLI_CONFIG", str(config))
    assert engine_in_force() == ("transformers", "config [defaults]")
    assert json.loads(run_cli(*args, "--engine", "native").stdout)["engine"] == "native"  # flag wins
    bad = run_cli(*args, "--engine", "fast")
    assert bad.returncode == 2
    assert bad.stderr.decode().strip().splitlines() == [
        "llmcli: error: --engine must be one of auto, native, transformers, got 'fast'"
    ]


FAMILY_CASES = [
    name for name in CASES if name.startswith(("qwen3-moe", "mixtral", "gemma", "phi", "gpt-oss"))
]


@pytest.mark.parametrize("static_shapes", [False, True], ids=["exact", "bucketed"])
@pytest.mark.parametrize("case", FAMILY_CASES)
@torch.inference_mode()
def test_a_check_row_is_its_decode_step(case: str, static_shapes: bool) -> None:
    """Speculation's check pass (score) gives each row what the decode step gives: the experts
    the same way, a sliding window's mask over exactly the positions seen or over the bucket;
    the dense products of 8 rows round as the Llama family's do: within 2e-5 of logits up to ~8
    (measured: 4e-6 to 9e-6, and 1.4e-5 for gpt-oss with its biases and one expert)."""
    native = NativeBackend(build(*CASES[case]), CONTEXT, static_shapes=static_shapes)
    ids = prompt(24, seed=2)
    native.prefill(ids[:12])
    rows = native.score(ids[12:20])
    native.crop(12)
    for i in range(12, 20):
        torch.testing.assert_close(native.decode(torch.tensor([ids[i]]))[0], rows[i - 12], rtol=0, atol=2e-5)


@torch.inference_mode()
def test_a_mixture_of_experts_decode_reads_only_the_chosen_experts() -> None:
    """A decode step touches the stacked expert tensors only through the token's k indices
    (an expert's slice, or a gather by index), never whole."""
    from torch.overrides import TorchFunctionMode

    from llmcli.engine.native.families import moe

    native = NativeBackend(build(*CASES["qwen3-moe-k2"]), CONTEXT)
    native.prefill(prompt(8))
    experts = [b.feed_forward for b in native.net.blocks if isinstance(b.feed_forward, moe.SparseExperts)]
    stacked = {id(t) for e in experts for t in (e.gate_up, e.down)}
    read: list[int] = []

    class Reads(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            if any(isinstance(a, torch.Tensor) and id(a) in stacked for a in args):
                if func is torch.Tensor.index_select and id(args[0]) in stacked:
                    read.append(args[2].numel())  # a gather of these experts
                elif func is torch.Tensor.__getitem__ and isinstance(args[1], int):
                    read.append(1)  # one expert's slice
                else:
                    read.append(10**6)  # the stacked tensor used whole: every expert read
            return func(*args, **(kwargs or {}))

    with Reads():
        native.decode(torch.tensor([3]))
    assert len(experts) == 2 and sum(read) == 2 * 2 * len(experts)  # k = 2 experts, gate_up and down


def longrope_phi(original: int) -> torch.nn.Module:
    """Phi-3.5-style longrope: short and long factors, one per rotated frequency pair."""
    half = 16 * 3 // 4 // 2  # head_dim 16, partial rotary 0.75
    rope = {
        "rope_type": "longrope",
        "rope_theta": 1e4,
        "partial_rotary_factor": 0.75,
        "short_factor": [1.0 + 0.1 * i for i in range(half)],
        "long_factor": [2.0 + 0.5 * i for i in range(half)],
        "original_max_position_embeddings": original,
    }
    return build("phi3", {"rope_parameters": rope, "original_max_position_embeddings": original, **PHI})


@torch.inference_mode()
def test_longrope_takes_the_factors_of_the_context_in_use() -> None:
    """Past the original length transformers uses the long factors; so does a load whose
    context is past it, from the first position. Within it, the short ones."""
    model = longrope_phi(original=16)
    ids = prompt(40, seed=3)
    reference = model(torch.tensor([ids])).logits[0].float()  # 40 > 16: long factors throughout
    long = NativeBackend(model, CONTEXT)
    torch.testing.assert_close(long.prefill(ids[:33])[0], reference[32], rtol=0, atol=1e-4)
    for i in range(33, 40):
        torch.testing.assert_close(long.decode(torch.tensor([ids[i]]))[0], reference[i], rtol=0, atol=1e-4)
    short_ids = ids[:12]
    short_reference = model(torch.tensor([short_ids])).logits[0].float()  # 12 ≤ 16: short factors
    short = NativeBackend(model, 16)
    torch.testing.assert_close(short.prefill(short_ids)[0], short_reference[-1], rtol=0, atol=1e-4)
    assert not torch.allclose(long.net.inv_freq, short.net.inv_freq)


GEMMA_RING = CASES["gemma3-window-8-shorter-than-the-prompt"]  # window 8: a ring of 8 + 64 slots


@pytest.mark.parametrize("static_shapes", [False, True], ids=["exact", "bucketed"])
@pytest.mark.parametrize(
    "case",
    [
        "gemma3-window-8-shorter-than-the-prompt",
        "mistral-window-16",
        "gpt-oss-k2-window-8",
        "gemma2-window-8-softcapped",
    ],
)
@torch.inference_mode()
def test_sliding_layers_keep_a_ring_of_their_window_and_match_transformers_across_wraps(
    monkeypatch: pytest.MonkeyPatch, case: str, static_shapes: bool
) -> None:
    """A 300-token prompt in chunks of 50 wraps each sliding layer's ring (window + 64 slots)
    several times; the logits after it and at every decode step still equal transformers', as
    do a check pass's rows (written into the wrapped ring) and a chunk after cropping back
    within the slack. (gpt-oss: its prefill attention with sinks in slices of 7 rows.)"""
    from llmcli.engine.native import attention, backend
    from llmcli.engine.native.kvcache import RING_SLACK

    monkeypatch.setattr(backend, "PREFILL_CHUNK", 50)
    monkeypatch.setattr(attention, "SCORED_ELEMENTS", 4 * 7 * 51)
    model = build(*CASES[case])
    ids = prompt(330, seed=4)
    reference = model(torch.tensor([ids])).logits[0].float()
    native = NativeBackend(model, CONTEXT, static_shapes=static_shapes)
    torch.testing.assert_close(native.prefill(ids[:300])[0], reference[299], rtol=0, atol=1e-4)
    for i in range(300, 310):
        torch.testing.assert_close(native.decode(torch.tensor([ids[i]]))[0], reference[i], rtol=0, atol=1e-4)
    rows = native.score(ids[310:327])  # speculation's longest check: 17 rows
    for i in range(310, 327):
        torch.testing.assert_close(rows[i - 310], reference[i], rtol=0, atol=1e-4)
    native.crop(300)  # 27 back, within the slack: the ring still holds the window before 300
    assert native.length == 300
    torch.testing.assert_close(native.prefill(ids[300:330])[0], reference[329], rtol=0, atol=1e-4)
    window = model.config.sliding_window
    slots = [keys.shape[1] for keys in native.cache.keys]
    sliding = [block.attention.window is not None for block in native.net.blocks]
    assert slots == [window + RING_SLACK if slides else 512 for slides in sliding]  # global: 330 in a bucket
    assert sum(sliding) >= 2


@torch.inference_mode()
def test_a_crop_past_the_rings_slack_is_prefilled_again_and_equals_a_fresh_prefill() -> None:
    """Chat's /undo and /retry crop further back than a ring can restore: the cache is emptied,
    the engine says so, and warming the conversation again runs it whole: the same logits as a
    fresh engine's, and the same greedy reply."""
    model = build(*GEMMA_RING)
    ids = prompt(200, seed=5)
    engine = Engine(NativeBackend(model, CONTEXT), frozenset(), CONTEXT)
    engine.prefill(ids)
    engine.crop_to(190)  # within the slack
    assert len(engine.cached_ids) == 190
    engine.crop_to(100)  # 100 back: positions 100-7 … 99 are overwritten in the rings
    assert engine.cached_ids == [] and engine.backend.length == 0
    assert engine.warm(ids[:150]) == 150  # run whole, not the 50 past the asked-for crop
    fresh = Engine(NativeBackend(model, CONTEXT), frozenset(), CONTEXT)
    fresh.warm(ids[:150])
    params = SamplingParams(temperature=0.0, max_new_tokens=24)
    reply = engine.generate(ids[:160], params, None)
    list(reply)
    expected = fresh.generate(ids[:160], params, None)
    list(expected)
    assert reply.result.token_ids == expected.result.token_ids
    assert len(set(expected.result.token_ids)) > 3


@torch.inference_mode()
def test_gemma_kv_memory_stays_flat_past_the_window() -> None:
    """The KV cache of a sliding model grows only in its global layers: at 400 positions the 3
    sliding layers of 4 hold 72 slots each, where a dense-attention cache holds a 512 bucket."""
    model = build(*GEMMA_RING)
    native = NativeBackend(model, CONTEXT)
    native.prefill(prompt(400, seed=6))
    per_slot = 2 * 2 * 24 * 4  # keys and values, 2 KV heads × head_dim 24, fp32
    assert native.cache.nbytes() == per_slot * (512 + 3 * 72)
    dense = NativeBackend(build("gemma3_text", {**GEMMA_RING[1], "sliding_window": 4096}), CONTEXT)
    dense.prefill(prompt(400, seed=6))
    assert dense.cache.nbytes() == per_slot * 4 * 512


@pytest.mark.parametrize("kind", ["int8", "int4"])
@pytest.mark.parametrize("case", ["qwen3-moe-k2", "gpt-oss-k2-window-8"])
@torch.inference_mode()
def test_quantized_experts_compute_what_their_dequantized_weights_do(case: str, kind: str) -> None:
    """`--quant` on a CPU quantizes each expert on its own (int4 where its group divides the
    width, else int8; biases kept). The native engine's prefill and decode with them equal the
    same model whose stacked experts hold the dequantized weights: the layout (gpt-oss's
    transposed, interleaved gate/up), the biases and the per-expert kernels read as intended."""
    import copy

    from llmcli.models.quantized import quantize_experts, stacked_experts

    quantized = build(*CASES[case])
    reference = copy.deepcopy(quantized)
    for experts, twin in zip(stacked_experts(quantized), stacked_experts(reference), strict=True):
        # int4 with groups of 32: gate/up (64 wide) takes it, down (48 wide) goes to int8.
        assert quantize_experts(experts, kind, 32) == ({"int8"} if kind == "int8" else {"int4", "int8"})
        transposed = bool(getattr(experts, "is_transposed", False))
        for name in ("gate_up", "down"):
            weights = [layer.dequantized() for layer in getattr(experts, f"_llmcli_{name}")]
            stacked = torch.stack([w.T if transposed else w for w in weights])
            getattr(twin, f"{name}_proj").copy_(stacked)
        assert experts.gate_up_proj.numel() == 0  # the stacked tensor is gone, its memory with it
    ids = prompt(30, seed=7)
    ours, theirs = NativeBackend(quantized, CONTEXT), NativeBackend(reference, CONTEXT)
    torch.testing.assert_close(ours.prefill(ids[:20]), theirs.prefill(ids[:20]), rtol=0, atol=1e-4)
    for token in ids[20:]:
        step = torch.tensor([token])
        torch.testing.assert_close(ours.decode(step), theirs.decode(step), rtol=0, atol=1e-4)


@pytest.mark.parametrize("case", ["llama-gqa2", "gemma3-window-8-shorter-than-the-prompt"])
@torch.inference_mode()
def test_a_sequence_joining_a_pool_part_way_equals_it_alone(case: str) -> None:
    """Slots of one pool: the first sequence decodes alone for four steps, then a second is
    prefilled (the pool growing to its second slot, the first's cache moved with it) and joins
    its steps; every row within 1e-5 of each sequence decoded alone."""
    model = build(*CASES[case])
    net = NativeBackend(model, CONTEXT).net
    pool = net.new_pool(CONTEXT)
    together = [NativeBackend(None, CONTEXT, net=net, pool=pool) for _ in range(2)]
    alone = [NativeBackend(model, CONTEXT) for _ in range(2)]
    prompts = [prompt(140, seed=60), prompt(120, seed=61)]
    tokens = [int(alone[0].prefill(prompts[0]).argmax())]
    torch.testing.assert_close(together[0].prefill(prompts[0]).argmax(), torch.tensor(tokens[0]))
    for step in range(10):
        if step == 4:
            expected = alone[1].prefill(prompts[1])
            torch.testing.assert_close(together[1].prefill(prompts[1]), expected, rtol=0, atol=1e-5)
            tokens.append(int(expected.argmax()))
        going = list(range(len(tokens)))
        rows = net.decode_sequences(torch.tensor(tokens), [together[s].cache for s in going])
        for sequence in going:
            expected = alone[sequence].decode(torch.tensor([tokens[sequence]]))
            torch.testing.assert_close(rows[sequence : sequence + 1], expected, rtol=0, atol=1e-5)
            tokens[sequence] = int(expected.argmax())


@pytest.mark.parametrize(
    "case",
    [
        "llama-gqa2",
        "qwen2-bias",
        "qwen3-moe-k2",
        "gemma3-window-8-shorter-than-the-prompt",
        "gpt-oss-k2-window-8",
    ],
)
@pytest.mark.parametrize("pooled", [False, True])
@torch.inference_mode()
def test_several_sequences_in_one_step_each_equal_it_alone(case: str, pooled: bool) -> None:
    """Three sequences of different lengths (two past a window-8 ring's wrap) decoded in one step
    each: every row's logits within 3e-5 of the same sequence decoded alone, step after step,
    and one sequence leaving the step part way changes nothing for the others. `pooled`: their
    caches slots of one pool, each layer's attention one masked call over them (with a gap in
    the slots once the middle one leaves)."""
    model = build(*CASES[case])
    alone = [NativeBackend(model, CONTEXT) for _ in range(3)]
    net = NativeBackend(model, CONTEXT).net
    pool = net.new_pool(CONTEXT) if pooled else None
    together = [NativeBackend(None, CONTEXT, net=net, pool=pool) for _ in range(3)]
    # Pooled: lengths alike enough for one call over the longest (plans.POOLED_FILL).
    lengths = (130, 90, 150) if pooled else (5, 90, 150)
    prompts = [prompt(length, seed=40 + length) for length in lengths]
    tokens = []
    for sequence, ids in enumerate(prompts):
        expected = alone[sequence].prefill(ids)
        torch.testing.assert_close(together[sequence].prefill(ids), expected, rtol=0, atol=1e-5)
        tokens.append(int(expected.argmax()))
    for step in range(12):
        going = [0, 1, 2] if step < 6 else [0, 2]  # the second leaves after six steps
        caches = [together[s].cache for s in going]
        positions = torch.tensor([cache.length for cache in caches])
        assert (PooledRows.of(caches, positions) is not None) == pooled  # a gap in the slots after six
        rows = together[0].net.decode_sequences(
            torch.tensor([tokens[s] for s in going]), [together[s].cache for s in going]
        )
        for row, sequence in enumerate(going):
            expected = alone[sequence].decode(torch.tensor([tokens[sequence]]))
            # Rows multiplied together in one GEMM, alone in a GEMV: another order of summation,
            # up to 1.4e-5 apart on transformers 5.24's initialisation of this model (measured).
            torch.testing.assert_close(rows[row : row + 1], expected, rtol=0, atol=3e-5)
            tokens[sequence] = int(expected.argmax())
