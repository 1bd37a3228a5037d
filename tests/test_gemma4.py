"""Gemma 4 text models on the native engine (tiny_models.GEMMA4_VARIANTS: sliding and wider full
layers, the last two reading the KV of earlier ones, keys that are values, per-layer inputs, a
double-wide MLP, soft-capped logits; "gemma4_moe" with experts beside each MLP; "gemma4_text"
with transformers' defaults for the rest): built from the folder without
transformers, its logits within 1e-4 of transformers' own model in fp32 after a prefill and at
every decode step, greedy tokens equal to `generate`, a chat's turns from the cache equal to the
conversation prefilled fresh, several sequences in one step equal to each alone. Auto runs it
natively: its KV cache crops as any other."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

import native_checks as check
from engines import engine_for

from test_serve import Server, served
from tiny_models import build_tiny_model

VOCAB = 400  # the tiny tokenizer's trained tokens (its specials lie past them)
CONTEXT = 512
ARCHS = ["gemma4", "gemma4_moe", "gemma4_text", "gemma4_vision"]


@pytest.fixture(scope="module", params=ARCHS)
def folder(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("models") / request.param, request.param)


@pytest.fixture(scope="module")
def dense(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("models") / "gemma4", "gemma4")


@pytest.fixture(scope="module")
def reference(folder: Path):
    return check.transformers_model(folder)


def load(folder: Path, engine: str = "auto"):
    return check.load_lean(folder, engine)


@pytest.fixture(scope="module")
def loaded(folder: Path):
    return load(folder)


def ids(count: int, seed: int) -> list[int]:
    return torch.randint(0, VOCAB, (count,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_auto_builds_it_natively_without_transformers(loaded, folder: Path) -> None:
    """The lean loader's model: a multimodal checkpoint's text part (gemma4_vision) as a text
    model's, its vision tower never read."""
    multimodal = folder.name == "gemma4_vision"
    architecture = "Gemma4ForConditionalGeneration" if multimodal else "Gemma4ForCausalLM"
    assert getattr(loaded.model, "architecture", None) == architecture
    assert engine_for(loaded).name == "native"


def test_a_reading_layer_has_no_cache_slot_of_its_own(dense: Path) -> None:
    """Six layers, the last two reading layers 2 and 3: four slots, the full ones wider."""
    from llmcli.engine.native.backend import NativeBackend

    backend = NativeBackend(load(dense).model, CONTEXT)
    assert [block.attention.layer for block in backend.net.blocks] == [0, 1, 2, 3, 2, 3]
    cache = backend.cache
    assert cache.shapes == [(2, 16), (1, 32), (2, 16), (1, 32)]
    backend.prefill(ids(10, seed=0))
    assert len(cache.keys) == 4 and cache.keys[1].shape[0] == 1 and cache.keys[1].shape[2] == 32


@pytest.mark.parametrize("static_shapes", [False, True], ids=["exact", "bucketed"])
def test_prefill_and_every_decode_step_match_transformers(loaded, reference, static_shapes: bool) -> None:
    """A prompt longer than the sliding layers' ring (8 + 64 slots), then 16 decode steps, each
    against transformers' whole-text pass; `bucketed`: the fixed-shape step a graph replays."""
    from llmcli.engine.native.backend import NativeBackend

    backend = NativeBackend(loaded.model, CONTEXT, static_shapes=static_shapes)
    worst = check.assert_prefill_and_steps_match(backend, reference, ids(80, seed=1))
    print(f"max |native - transformers| over prefill and 16 steps: {worst:.2e}")


def test_the_native_engine_runs_the_model_transformers_built_too(reference) -> None:
    """Over transformers' own modules (where the lean loader does not build: a checkpoint that
    comes quantized, a tokenizer built in code), a multimodal one's language model included."""
    from llmcli.engine.native.backend import NativeBackend

    check.assert_prefill_and_steps_match(
        NativeBackend(reference, CONTEXT), reference, ids(40, seed=9), steps=4
    )


def test_48_greedy_tokens_equal_transformers_generate(loaded, reference) -> None:
    from llmcli.engine.native.backend import NativeBackend

    check.assert_greedy_equals_generate(NativeBackend(loaded.model, CONTEXT), reference, ids(20, seed=2), 48)


def test_a_speculative_check_gives_each_row_what_its_decode_step_would(loaded, reference) -> None:
    from llmcli.engine.native.backend import NativeBackend

    backend = NativeBackend(loaded.model, CONTEXT)
    check.assert_check_rows_are_decode_steps(backend, reference, ids(30, seed=7), ids(5, seed=8))


def test_a_chat_of_four_turns_keeps_its_cache_and_equals_each_conversation_prefilled(
    loaded, reference
) -> None:
    """Each turn extends what the cache holds, after a template that rewrites the end of the
    last reply (its last token dropped): the cache is cropped back to the shared prefix, and the
    rest prefilled, to the logits of the whole conversation run at once. The second turn's 80
    new tokens overwrite the sliding layers' whole ring (8 + 64 slots) in one chunk."""
    engine = engine_for(loaded, frozenset())
    conversation: list[int] = []
    for turn, added in enumerate((25, 80, 25, 25)):
        conversation = conversation[:-1] + ids(added, seed=10 + turn)
        kept = engine.reuse_prefix(conversation)
        if turn:
            assert kept >= 0.9 * (len(conversation) - added)
        logits = engine.prefill(conversation[kept:])
        assert (logits - check.last_logits(reference, conversation)).abs().max().item() < check.ATOL, turn
        for _ in range(6):
            logits = engine.decode_step(int(logits.argmax()))
        conversation = list(engine.cached_ids)


@torch.inference_mode()
def test_several_sequences_in_one_step_each_equal_it_alone(loaded, folder: Path) -> None:
    """Three sequences in one pool (one masked attention call per layer, the wide and narrow
    slots each their own), decoded in one step each: every row within 3e-5 of it decoded alone
    (as tests/test_native.py holds the others), its greedy token the same. Rows multiplied
    together in one GEMM sum in another order; the experts' model (routing, expert and layer
    scales of 0.5-1.5 over logits of up to 7) carries that further: up to 2.6e-4 apart, measured
    with and without the pool alike, so it is held to 5e-4 there."""
    from llmcli.engine.native.backend import NativeBackend

    model, tolerance = loaded.model, 5e-4 if folder.name == "gemma4_moe" else 3e-5
    alone = [NativeBackend(model, CONTEXT) for _ in range(3)]
    net = NativeBackend(model, CONTEXT).net
    pool = net.new_pool(CONTEXT)
    together = [NativeBackend(None, CONTEXT, net=net, pool=pool) for _ in range(3)]
    tokens = []
    for sequence, length in enumerate((130, 90, 150)):
        prompt = ids(length, seed=40 + length)
        expected = alone[sequence].prefill(prompt)
        torch.testing.assert_close(together[sequence].prefill(prompt), expected, rtol=0, atol=1e-5)
        tokens.append(int(expected.argmax()))
    for _ in range(8):
        rows = net.decode_sequences(torch.tensor(tokens), [backend.cache for backend in together])
        for sequence in range(3):
            expected = alone[sequence].decode(torch.tensor([tokens[sequence]]))
            torch.testing.assert_close(rows[sequence : sequence + 1], expected, rtol=0, atol=tolerance)
            assert int(rows[sequence].argmax()) == int(expected.argmax())
            tokens[sequence] = int(expected.argmax())


def test_generate_imports_no_transformers_and_replies_as_transformers(dense: Path) -> None:
    check.assert_native_cli_replies_as_transformers(dense, "--engine", "transformers")


def damaged_copy(
    source: Path, destination: Path, config: dict | None = None, drop: str | None = None
) -> Path:
    """`source` copied with config.json's values changed by `config` and the tensor `drop` left out."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(source, destination)
    settings = json.loads((source / "config.json").read_text()) | (config or {})
    (destination / "config.json").write_text(json.dumps(settings))
    if drop is not None:
        weights = load_file(source / "model.safetensors")
        del weights[drop]
        save_file(weights, destination / "model.safetensors", metadata={"format": "pt"})
    return destination


@pytest.mark.parametrize(
    ("change", "named"),
    [
        # Layers 4 and 5 (full) share KV, and no full layer comes before them: a later one's.
        (
            {
                "config": {
                    "layer_types": ["sliding_attention"] * 4 + ["full_attention"] * 2,
                    "per_layer_config": {},
                }
            },
            "layer 4 (full_attention) read the keys and values of a later layer",
        ),
        (
            {"drop": "model.layers.1.self_attn.k_proj.weight"},
            "lacks the tensor model.layers.1.self_attn.k_proj.weight",
        ),
    ],
    ids=["kv-sharing-from-a-later-layer", "a-tensor-missing"],
)
def test_a_checkpoint_that_cannot_be_laid_out_is_refused_in_one_line_before_it_runs(
    dense: Path, tmp_path: Path, change: dict, named: str
) -> None:
    """Found from config.json and the safetensors headers by the native builder's checks: no
    weight read, transformers never imported (its loader would name a missing tensor too, after
    reading the rest)."""
    from cli_helpers import run_cli, run_reporting_imports

    folder = damaged_copy(dense, tmp_path / "damaged", **change)
    args = ("generate", "-m", str(folder), "-n", "2", "Hi")
    proc = run_cli(*args)
    stderr = proc.stderr.decode()
    assert proc.returncode != 0 and named in stderr and "Traceback" not in stderr, stderr
    assert stderr.count("\n") == 1 and proc.stdout == b""
    assert f"exit {proc.returncode} imported -" in run_reporting_imports(*args).stderr


# configs/: each Gemma 4 size's text model, and its parameters as the model cards count them
# (E2B and E4B "effective": without the per-layer embedding table; the 12B's card gives none).
SIZES = {
    "gemma-4-e2b": ("effective", 2.3, 0.05),
    "gemma-4-e4b": ("effective", 4.5, 0.15),
    "gemma-4-12b": ("total", 12.0, 0.5),
    "gemma-4-26b-a4b": ("total", 25.2, 0.05),
    "gemma-4-31b": ("total", 30.7, 0.05),
}


@pytest.mark.parametrize("name", sorted(SIZES))
def test_each_shipped_size_loads_with_random_weights_on_the_meta_device(name: str) -> None:
    """transformers builds each on the meta device (no memory) to the card's parameter count;
    llmcli reads the same config into the same tensors (every name the checkpoint would hold)
    and the native engine lays out its cache: a slot for each layer computing keys and values,
    of its kind's shape."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from llmcli.engine.native.forward import Transformer
    from llmcli.models.gemma4_layout import expected_tensors, kv_sources, layer_shapes
    from llmcli.models.lean_config import LeanConfig
    from llmcli.models.lean_model import check_computes

    path = Path(__file__).parent.parent / "configs" / f"{name}.json"
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))
    count, billions, within = SIZES[name]
    parameters = sum(p.numel() for p in model.parameters())
    if count == "effective":
        parameters -= model.model.embed_tokens_per_layer.weight.numel()
    assert parameters / 1e9 == pytest.approx(billions, abs=within)

    config = LeanConfig(json.loads(path.read_text()))
    check_computes(config)
    assert set(expected_tensors(config)) == set(model.state_dict()) - {"lm_head.weight"}
    transformers_config = model.config
    attentions = [layer.self_attn for layer in model.model.layers]
    assert layer_shapes(config) == [
        (attn.head_dim, transformers_config.num_attention_heads // attn.num_key_value_groups)
        for attn in attentions
    ]
    net = Transformer(model, 4096)
    sources = kv_sources(config)
    writers = [i for i, source in enumerate(sources) if source == i]
    windows, shapes, kept = net._slots()
    assert len(shapes) == net.shape.layers == len(writers) and all(kept)
    assert shapes == [layer_shapes(config)[i][::-1] for i in writers]
    assert windows == [
        config.sliding_window if config.layer_types[i] == "sliding_attention" else None for i in writers
    ]


def test_models_show_says_auto_runs_it_natively(dense: Path) -> None:
    from cli_helpers import run_cli

    shown = json.loads(run_cli("models", "show", str(dense), "--json").stdout)
    assert shown["engine"]["auto"] == "native" and "Gemma4ForCausalLM" in shown["engine"]["why"]
    text = run_cli("models", "show", str(dense)).stdout.decode()
    assert "engine         native under --engine auto" in text


@pytest.fixture(scope="module")
def vision_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    folder = build_tiny_model(tmp_path_factory.mktemp("models") / "gemma4_vision", "gemma4_vision")
    yield from served(folder, tmp_path_factory.mktemp("runtime"), "--parallel", "3")


def test_a_server_batches_it_and_refuses_an_image_in_one_line(vision_server: Server) -> None:
    """The multimodal checkpoint served for text: requests at once each reply as alone (their
    decode steps batched), and an image its template cannot place is a 400."""
    client = vision_server.client()
    prompts = ["Hello there, how are you today?", "What is the capital of France?", "def main():"]

    def ask(prompt: str) -> str:
        reply = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": prompt}], max_tokens=12, temperature=0
        )
        return reply.choices[0].message.content or ""

    alone = [ask(prompt) for prompt in prompts]
    with ThreadPoolExecutor(len(prompts)) as pool:
        assert list(pool.map(ask, prompts)) == alone
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    body = {"messages": [{"role": "user", "content": [{"type": "text", "text": "What is it?"}, image]}]}
    status, answer = vision_server.raw("POST", "/v1/chat/completions", json.dumps(body).encode())
    # Its tiny template writes a message's content as text: it cannot place an image.
    assert status == 400 and "cannot place an image" in answer["error"]["message"]


def test_int8_weights_run_natively(folder: Path) -> None:
    """--quant int8 quantizes every linear layer, the router's and the per-layer inputs' too (8
    wide here, narrower than torch's CPU int8 kernel reads: it runs dequantized), and each expert:
    the native engine runs what the quantizer made (it met a router without a weight, and the
    kernel crashed the process on the narrow layer)."""
    from cli_helpers import run_cli

    args = ("generate", "-m", str(folder), "--quant", "int8", "-t", "0", "-n", "8", "--json", "Hello")
    proc = run_cli(*args)
    assert proc.returncode == 0, proc.stderr.decode()
    record = json.loads(proc.stdout)
    assert record["engine"] == "native" and record["completion_tokens"] == 8


def test_kv_bytes_per_token_counts_each_slot_at_its_own_width(loaded) -> None:
    """What --json, the server's budget and the estimates say a token costs is what the cache
    holds per position: each layer that computes keys and values at its own width (the full
    layers wider), none for the layers reading another's."""
    from llmcli.engine.native.forward import Transformer

    net = Transformer(loaded.model, CONTEXT)
    _, shapes, kept = net._slots()
    slots = zip(shapes, kept, strict=True)
    per_token = sum(2 * heads * width * 4 for (heads, width), keeps in slots if keeps)
    assert loaded.kv_bytes_per_token == per_token
