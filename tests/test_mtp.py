"""--speculative mtp: a Qwen3.5 (dense or MoE) or Qwen3-Next model drafts with its own
multi-token-prediction head.

The tiny models get an MTP module in the published checkpoints' layout (tensors made here:
transformers has no MTP module, it drops `mtp.*` at load; an MoE one's layer has the body's
experts and shared expert). The head's forward is checked against one assembled from
transformers' own layer and norms of the model's family, in fp32; the drafts
never change the output (greedy, 64 tokens, equal to decoding without them), with a random head
(drafts rejected) and with a head that is often right (drafts accepted, and checks cut inside
their run: the recurrent state goes back to a row inside the check); the acceptance rate comes
in --json; a checkpoint without the head, or an engine other than the native one, is refused in one line.
"""

from __future__ import annotations

import contextlib
import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engines import engine_for
from llmcli.config.settings import LoadSettings, SamplingParams
from llmcli.engine.loop import Engine
from llmcli.engine.native.backend import NativeBackend
from llmcli.engine.native.mtp import MtpHead
from llmcli.engine.speculative import Speculation
from llmcli.engine.speculative.drafters import MtpDrafter
from llmcli.engine.speculative.schedule import DraftLength
from llmcli.models.load import load_model
from llmcli.models.resolve import resolve_model

from cli_helpers import one_error_line, run_cli
from test_serve import served
from tiny_models import build_tiny_model

serving = contextlib.contextmanager(served)  # a server stopped and checked whatever the test does

ATOL = 1e-4
VOCAB = 400  # the tiny tokenizer's trained tokens (its specials lie past them)


def add_mtp_head(folder: Path, seed: int = 0, predicting: bool = False, stacked: bool = False) -> Path:
    """The model's safetensors file with an MTP module added, shaped as Qwen3.5's (one gated
    full-attention layer; vLLM's Qwen3_5MultiTokenPredictor reads these names), random. Its MLP
    is shaped as the body's full-attention layer's: dense, or an MoE model's router, experts
    (one tensor per expert, or with `stacked` in transformers 5's [experts, …] layout, as
    Qwen3.5-MoE's release stores them) and gated shared expert. With `predicting`, a head that
    is often right: the model's layers are made to add little (their output projections scaled
    by LAYERS_SCALE), so it is close to a bigram model of its embedding and head, and the head
    computes that very bigram step from the next token (fc passes its embedding through, the
    MTP layer adds nothing, the MTP norm is the model's)."""
    config = json.loads((folder / "config.json").read_text())
    config = config.get("text_config", config)  # a vision-language checkpoint's language model
    hidden = config["hidden_size"]
    heads, kv_heads, head_dim = (
        config["num_attention_heads"],
        config["num_key_value_heads"],
        config["head_dim"],
    )
    generator = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator) * 0.2

    path = folder / "model.safetensors"
    model = load_file(path)
    layer = "mtp.layers.0"
    body_mlp = f"layers.{config['layer_types'].index('full_attention')}.mlp."
    mlp = {
        f"{layer}.mlp.{name.split(body_mlp, 1)[1]}": rand(*tensor.shape)
        for name, tensor in model.items()
        if body_mlp in name
    }
    tensors = {
        "mtp.fc.weight": rand(hidden, 2 * hidden),
        "mtp.pre_fc_norm_embedding.weight": rand(hidden),
        "mtp.pre_fc_norm_hidden.weight": rand(hidden),
        "mtp.norm.weight": rand(hidden),
        f"{layer}.input_layernorm.weight": rand(hidden),
        f"{layer}.post_attention_layernorm.weight": rand(hidden),
        f"{layer}.self_attn.q_proj.weight": rand(2 * heads * head_dim, hidden),  # query and gate
        f"{layer}.self_attn.k_proj.weight": rand(kv_heads * head_dim, hidden),
        f"{layer}.self_attn.v_proj.weight": rand(kv_heads * head_dim, hidden),
        f"{layer}.self_attn.o_proj.weight": rand(hidden, heads * head_dim),
        f"{layer}.self_attn.q_norm.weight": rand(head_dim),
        f"{layer}.self_attn.k_norm.weight": rand(head_dim),
    } | (stacked_experts(mlp) if stacked else mlp)
    if predicting:
        for name in model:
            if name.startswith(("model.layers.", "model.language_model.layers.")) and name.endswith(
                ("out_proj.weight", "o_proj.weight", "down_proj.weight")
            ):
                model[name] = model[name] * LAYERS_SCALE
        tensors["mtp.fc.weight"] = torch.cat((torch.eye(hidden), torch.zeros(hidden, hidden)), dim=1)
        tensors["mtp.pre_fc_norm_embedding.weight"] = torch.zeros(hidden)
        norm = (
            "model.language_model.norm.weight"
            if "text_config" in json.loads((folder / "config.json").read_text())
            else "model.norm.weight"
        )
        tensors["mtp.norm.weight"] = model[norm].clone()
        for name in tensors:  # what the MTP layer writes into its stream: nothing
            if name.endswith(("o_proj.weight", "down_proj.weight", "down_proj")):
                tensors[name] = torch.zeros_like(tensors[name])
    save_file(model | tensors, path, metadata={"format": "pt"})
    return folder


def stacked_experts(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`weights` with each layer's per-expert matrices (`….experts.{e}.{gate,up,down}_proj.weight`)
    as transformers 5 stacks them: `experts.gate_up_proj` [experts, 2 × inter, hidden] and
    `experts.down_proj` [experts, hidden, inter]; the other tensors (stacked ones too) as they are."""
    per_expert = re.compile(r"(.*)\.experts\.(\d+)\.(gate|up|down)_proj\.weight")
    out = {name: tensor for name, tensor in weights.items() if not per_expert.fullmatch(name)}
    matrices: dict[str, dict[str, dict[int, torch.Tensor]]] = {}  # block → kind → expert → matrix
    for name, tensor in weights.items():
        found = per_expert.fullmatch(name)
        if found:
            matrices.setdefault(found[1], {}).setdefault(found[3], {})[int(found[2])] = tensor
    for block, kinds in matrices.items():
        gate, up, down = (
            [by_expert[e] for e in sorted(by_expert)] for by_expert in map(kinds.get, ("gate", "up", "down"))
        )
        out[f"{block}.experts.gate_up_proj"] = torch.stack(
            [torch.cat(pair) for pair in zip(gate, up, strict=True)]
        )
        out[f"{block}.experts.down_proj"] = torch.stack(down)
    return out


# The predicting head's model: its layers still change the tokens (a state rolled back wrong
# would show), and the head's drafts are accepted about a third of the time (measured).
LAYERS_SCALE = 0.02


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {
        "plain": build_tiny_model(root / "plain", "qwen3_5"),
        "random": add_mtp_head(build_tiny_model(root / "random", "qwen3_5")),
        "predicting": add_mtp_head(build_tiny_model(root / "predicting", "qwen3_5"), predicting=True),
        "vision-language": add_mtp_head(build_tiny_model(root / "vl", "qwen3_5_vl")),
        # Qwen3.5-MoE: the MTP layer's experts stacked as Qwen's release stores them, or one
        # tensor each as transformers saves them; Qwen3-Next's module is the same as Qwen3.5-MoE's.
        "moe-plain": build_tiny_model(root / "moe-plain", "qwen3_5_moe"),
        "moe": add_mtp_head(build_tiny_model(root / "moe", "qwen3_5_moe"), stacked=True),
        "moe-predicting": add_mtp_head(
            build_tiny_model(root / "moe-predicting", "qwen3_5_moe"), predicting=True
        ),
        "moe-vision-language": add_mtp_head(
            build_tiny_model(root / "moe-vl", "qwen3_5_moe_vl"), stacked=True
        ),
        "next": add_mtp_head(build_tiny_model(root / "next", "qwen3_next")),
    }


def load(folder: Path, mtp: bool = True):
    settings = LoadSettings(device="cpu", dtype="fp32", threads=1, engine="native")
    return load_model(resolve_model(str(folder)), settings, lean=True, mtp=mtp)


def ids(count: int, seed: int) -> list[int]:
    return torch.randint(0, VOCAB, (count,), generator=torch.Generator().manual_seed(seed)).tolist()


def reference_mtp(folder: Path, tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The MTP module's outputs after its norm [T − 1, hidden] and logits [T − 1, vocab] over
    `tokens`, built from the model's own transformers modules (Qwen3.5's, Qwen3.5-MoE's,
    Qwen3-Next's): the model's final-norm hidden states, then fc over [norm(embedding of the
    next token), norm(hidden)], one full-attention decoder layer of the body's class (its MLP
    as the body's) with causal attention at positions 0…T − 2, the MTP norm and the model's
    lm_head."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    config = model.config
    weights = {
        k.removeprefix("mtp."): v
        for k, v in load_file(folder / "model.safetensors").items()
        if k.startswith("mtp.")
    }
    full = config.layer_types.index("full_attention")
    layer = type(model.model.layers[full])(config, full).eval()
    layer.load_state_dict(
        stacked_experts(
            {k.removeprefix("layers.0."): v for k, v in weights.items() if k.startswith("layers.0.")}
        )
    )
    norms = {}
    for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        norms[name] = type(model.model.norm)(config.hidden_size, eps=config.rms_norm_eps)
        norms[name].weight.data.copy_(weights[f"{name}.weight"])
    with torch.inference_mode():
        ids_tensor = torch.tensor([tokens])
        hidden = model.model(ids_tensor).last_hidden_state[0]
        embedded = model.model.embed_tokens(ids_tensor[0, 1:])
        both = torch.cat(
            (norms["pre_fc_norm_embedding"](embedded), norms["pre_fc_norm_hidden"](hidden[:-1])), -1
        )
        x = torch.nn.functional.linear(both, weights["fc.weight"])[None]
        count = x.shape[1]
        positions = torch.arange(count)[None]  # Qwen3.5's rotary spreads it over its three sections
        rope = model.model.rotary_emb(x, positions)
        causal = torch.full((count, count), float("-inf")).triu(1)[None, None]
        out = norms["norm"](layer(x, position_embeddings=rope, attention_mask=causal))[0]
        return out, model.lm_head(out)


@pytest.mark.parametrize("kind", ["random", "moe", "moe-predicting", "next"])
def test_the_head_computes_what_qwen3_5s_modules_assembled_compute(
    models: dict[str, Path], kind: str
) -> None:
    """Every row after the MTP norm, and the last row's logits, within 1e-4 of the reference;
    run in two pieces (its cache kept between) as in one."""
    folder = models[kind]
    tokens = ids(24, seed=1)
    expected_out, expected_logits = reference_mtp(folder, tokens)
    loaded = load(folder)
    backend = NativeBackend(loaded.model, 256)
    rows: list[torch.Tensor] = []
    backend.net.hidden_tap = lambda plan, normed: rows.append(normed)
    backend.prefill(tokens)  # in pieces: the cache checkpoints its states one token before the end
    hidden = torch.cat(rows)
    head = MtpHead(loaded.model, backend.net, 256)
    out, logits = head.run(torch.tensor(tokens[1:]), hidden[:-1])
    assert (out - expected_out).abs().max().item() < ATOL
    assert (logits - expected_logits[-1:]).abs().max().item() < ATOL
    head.cache.crop(0)
    head.run(torch.tensor(tokens[1:10]), hidden[:9])
    out, logits = head.run(torch.tensor(tokens[10:]), hidden[9:-1])
    assert (out - expected_out[9:]).abs().max().item() < ATOL
    assert (logits - expected_logits[-1:]).abs().max().item() < ATOL


def generate(engine: Engine, prompt: list[int], tokenizer, count: int = 64):
    generation = engine.generate(prompt, SamplingParams(temperature=0.0, max_new_tokens=count), tokenizer)
    list(generation)
    return generation.result


@pytest.mark.parametrize(
    "kind",
    ["random", "predicting", "vision-language", "moe", "moe-predicting", "moe-vision-language", "next"],
)
def test_drafts_never_change_the_greedy_output(models: dict[str, Path], kind: str) -> None:
    """64 greedy tokens equal to decoding without drafts, three drafted every round, over two
    turns (the second from the first's cache); the cache holds what it would without drafts."""
    loaded = load(models[kind])
    plain = engine_for(loaded, backend="native")
    engine = engine_for(loaded, backend="native")
    engine.speculation = Speculation(
        MtpDrafter(engine, MtpHead(loaded.model, engine.backend.net, 1024)), DraftLength(3)
    )
    prompt = ids(20, seed=2)
    for turn in range(2):
        expected = generate(plain, prompt, loaded.tokenizer)
        got = generate(engine, prompt, loaded.tokenizer)
        assert got.token_ids == expected.token_ids, turn
        assert engine.cached_ids == plain.cached_ids and engine.backend.length == len(engine.cached_ids)
        stats = got.stats.speculative
        assert stats is not None and stats.method == "mtp" and stats.drafted > 0
        if not kind.endswith("predicting"):
            assert stats.accepted < stats.drafted
        else:  # accepted runs, and rejections inside them: the state went back within a check
            assert 0 < stats.accepted < stats.drafted, (stats.accepted, stats.drafted)
        prompt = prompt + got.token_ids + ids(8, seed=3 + turn)


def generate_json(folder: Path, *extra: str) -> dict:
    base = ["generate", "-m", str(folder), "--no-server", "--threads", "1", "-t", "0", "-n", "64", "--json"]
    result = run_cli(*base, *extra, "The capital of France")
    assert result.returncode == 0, result.stderr.decode()
    return json.loads(result.stdout)


@pytest.mark.parametrize("kind", ["predicting", "moe-predicting"])
def test_generate_json_reports_the_acceptance_rate_and_the_same_text(
    models: dict[str, Path], kind: str
) -> None:
    """Under auto (the native engine runs Qwen3.5 and Qwen3.5-MoE) and --engine native alike."""
    plain = generate_json(models[kind], "--engine", "native")
    drafted = generate_json(models[kind], "--speculative", "mtp", "--draft-tokens", "3")
    assert plain["speculative"] is None
    assert (
        drafted["text"] == plain["text"] and drafted["completion_tokens"] == plain["completion_tokens"] == 64
    )
    stats = drafted["speculative"]
    assert stats["method"] == "mtp" and 0 < stats["accepted"] < stats["drafted"]
    assert stats["acceptance_rate"] == stats["accepted"] / stats["drafted"]


@pytest.mark.parametrize(
    ("model", "extra", "words"),
    [
        ("plain", ("--engine", "native"), "has no MTP head (no mtp.* tensors)"),
        ("moe-plain", ("--engine", "native"), "has no MTP head (no mtp.* tensors)"),
        ("random", ("--engine", "transformers"), "--speculative mtp drafts on the native engine"),
        ("random", ("--engine", "native", "--draft-model", "self"), "not with --draft-model"),
    ],
)
def test_mtp_where_it_cannot_draft_is_refused_in_one_line(
    models: dict[str, Path], model: str, extra: tuple[str, ...], words: str
) -> None:
    result = run_cli(
        "generate", "-m", str(models[model]), "--no-server", "--speculative", "mtp", *extra, "Hi"
    )
    assert words in one_error_line(result, 2)
    assert result.stdout == b""


def test_a_server_started_with_mtp_drafts_per_request(models: dict[str, Path], tmp_path: Path) -> None:
    """The same reply with and without the head's drafts, the drafts reported; a call asking for
    them goes through that server; a server started without the head answers a request for it
    with a 400 in OpenAI's shape, and a call asking for them loads the model in-process."""
    body = {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 24, "temperature": 0}
    extra = ("--engine", "native", "--speculative", "mtp", "--draft-tokens", "3")
    with serving(models["predicting"], tmp_path / "with", *extra) as server:
        status, drafted = server.raw("POST", "/v1/chat/completions", json.dumps(body).encode())
        assert status == 200, drafted
        status, plain = server.raw(
            "POST", "/v1/chat/completions", json.dumps({**body, "speculative": "off"}).encode()
        )
        through = call_with_mtp(models["predicting"], server.runtime)
    assert through["server"] is not None and through["speculative"]["method"] == "mtp"
    assert status == 200 and plain["timings"]["speculative"] is None
    assert drafted["choices"][0]["message"]["content"] == plain["choices"][0]["message"]["content"]
    stats = drafted["timings"]["speculative"]
    assert stats["method"] == "mtp" and stats["drafted"] > 0
    with serving(models["predicting"], tmp_path / "without", "--engine", "native") as server:
        status, refused = server.raw(
            "POST", "/v1/chat/completions", json.dumps({**body, "speculative": "mtp"}).encode()
        )
        here = call_with_mtp(models["predicting"], server.runtime)
    assert status == 400 and "--speculative mtp" in refused["error"]["message"]
    assert here["server"] is None and here["text"] == through["text"]


def call_with_mtp(folder: Path, runtime: Path) -> dict:
    """`generate --speculative mtp --json` where the servers of `runtime` may serve it."""
    args = ["-m", str(folder), "--device", "cpu", "--dtype", "fp32", "--engine", "native", "-t", "0"]
    result = run_cli(
        "generate", *args, "-n", "12", "--json", "--speculative", "mtp", "Hello",
        env={"XDG_RUNTIME_DIR": str(runtime)},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr.decode()
    return json.loads(result.stdout)


def test_sampled_drafts_carry_the_distribution_each_was_drawn_from(models: dict[str, Path]) -> None:
    """A sampled draft gives the acceptance rule its q: one row per token, the token drawn
    from it; and the head's chained entries are cropped after each draft."""
    loaded = load(models["random"])
    engine = engine_for(loaded, backend="native")
    drafter = MtpDrafter(engine, MtpHead(loaded.model, engine.backend.net, 1024))
    prompt = ids(16, seed=4)
    engine.prefill(prompt)
    params = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0)
    draft = drafter.propose([*prompt, 7], 4, params, torch.Generator().manual_seed(0))
    assert draft.probs is not None and draft.probs.shape[0] == len(draft.tokens) == 4
    assert all(float(row[token]) > 0 for row, token in zip(draft.probs, draft.tokens, strict=True))
    assert drafter.head.cache.length == len(prompt)  # an entry per position the model has run
