"""The lean load path (models/lean_*.py): a Llama-family folder read without transformers must
give what transformers' path gives — the same tokenizer answers, the same rendered templates,
the same RoPE table and the same logits — and a one-shot call on it must not import transformers."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from test_chat_cache import THINK_DROPPING_TEMPLATE
from test_native import BASE, CASES, PHI, build
from test_reasoning import HARMONY_TEMPLATE, THINKING_TEMPLATE

from cli_helpers import one_error_line, run_cli, run_reporting_imports
from tiny_models import CHATML_TEMPLATE, build_tiny_model, mxfp4_experts, train_tokenizer
from tool_templates import HERMES_TEMPLATE, MISTRAL_TEMPLATE, TOOLS

TEMPLATES = {
    "chatml": CHATML_TEMPLATE,
    "think-dropping": THINK_DROPPING_TEMPLATE,
    "thinking": THINKING_TEMPLATE,
    "hermes-tools": HERMES_TEMPLATE,
    "mistral-tools": MISTRAL_TEMPLATE,
    "harmony": HARMONY_TEMPLATE,
}
CONVERSATIONS = {
    "system-less": [{"role": "user", "content": "Hi there, 你好 😀"}],
    "with-system": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}],
    "multi-turn": [
        {"role": "user", "content": "One"},
        {"role": "assistant", "content": "<think>\nhm\n</think>\n\nTwo"},
        {"role": "user", "content": "Three <|im_end|> four"},
    ],
}
TEXTS = [
    "Hello world",
    " leading  space\n\n\tx",
    "<|im_start|>user\nhi<|im_end|>",
    "emoji 👍🏽 and 日本語 123456, it's DON'T",
    "",
]


@pytest.fixture(
    scope="module",
    params=[
        ("bytelevel", None, {}),
        ("metaspace", None, {}),
        ("bytelevel", "Qwen2Tokenizer", {}),
        # the class takes the config's add_prefix_space over the file's pre-tokenizer
        ("bytelevel", "GPT2Tokenizer", {"add_prefix_space": True}),
    ],
    ids=["bytelevel", "metaspace", "qwen2-class", "gpt2-class-prefix-space"],
)
def tokenizer_folder(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A trained tokenizer saved as transformers saves it; with a class named, under that class,
    which transformers then rebuilds its own way (its own pre-tokenizer, say)."""
    style, tokenizer_class, settings = request.param
    tokenizer = train_tokenizer(style=style, added=("<tool_call>",), special=("<think>", "</think>"))
    folder = tmp_path_factory.mktemp(f"tokenizer-{style}")
    tokenizer.save_pretrained(folder)
    if tokenizer_class:
        config = json.loads((folder / "tokenizer_config.json").read_text())
        del config["unk_token"]  # the class's default stands in
        (folder / "tokenizer_config.json").write_text(
            json.dumps(config | {"tokenizer_class": tokenizer_class, **settings})
        )
    return folder


def test_the_lean_tokenizer_answers_as_transformers_does(tokenizer_folder: Path) -> None:
    from transformers import AutoTokenizer

    from llmcli.models.lean_tokenizer import LeanTokenizer

    ours, theirs = LeanTokenizer(tokenizer_folder), AutoTokenizer.from_pretrained(tokenizer_folder)
    assert type(theirs).__name__ == json.loads((tokenizer_folder / "tokenizer_config.json").read_text()).get(
        "tokenizer_class", type(theirs).__name__
    )
    for text in TEXTS:
        for special in (True, False):
            assert ours(text, add_special_tokens=special)["input_ids"] == list(
                theirs(text, add_special_tokens=special)["input_ids"]
            ), text
    ids = theirs("<|im_start|>assistant\n<think>hm</think> 👍🏽 done<|im_end|>")["input_ids"]
    for skip in (True, False):
        assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(ids, skip_special_tokens=skip)
    assert ours.decode(ids[:5]) == theirs.decode(ids[:5])
    assert ours.get_vocab() == theirs.get_vocab()
    assert ours.get_added_vocab() == theirs.get_added_vocab()
    assert {i: (t.content, t.special) for i, t in ours.added_tokens_decoder.items()} == {
        i: (t.content, t.special) for i, t in theirs.added_tokens_decoder.items()
    }
    named = {key: value for key, value in theirs.special_tokens_map.items() if isinstance(value, str)}
    assert ours.special_tokens_map == named
    assert sorted(ours.all_special_tokens) == sorted(theirs.all_special_tokens)
    for name in ("bos_token", "eos_token", "pad_token", "unk_token"):
        assert getattr(ours, name) == getattr(theirs, name), name
        assert getattr(ours, f"{name}_id") == getattr(theirs, f"{name}_id"), name
    assert ours.convert_tokens_to_ids(["<think>", "<tool_call>"]) == theirs.convert_tokens_to_ids(
        ["<think>", "<tool_call>"]
    )
    assert len(ours) == len(theirs)


@pytest.mark.parametrize("template", list(TEMPLATES))
@pytest.mark.parametrize("conversation", list(CONVERSATIONS))
def test_templates_render_as_transformers_apply_chat_template(
    tokenizer_folder: Path, template: str, conversation: str
) -> None:
    """llmcli's sandboxed renderer over the lean tokenizer, byte for byte against transformers'
    apply_chat_template: with and without tools, thinking switched off and not, prompts open
    and closed."""
    from jinja2.exceptions import TemplateError
    from transformers import AutoTokenizer

    from llmcli.engine.conversation import render_chat
    from llmcli.models.lean_tokenizer import LeanTokenizer

    (tokenizer_folder / "chat_template.jinja").write_text(TEMPLATES[template])
    ours, theirs = LeanTokenizer(tokenizer_folder), AutoTokenizer.from_pretrained(tokenizer_folder)
    messages = CONVERSATIONS[conversation]
    for options in ({}, {"tools": TOOLS}, {"enable_thinking": False}):
        for generation_prompt in (True, False):
            try:
                expected = theirs.apply_chat_template(
                    messages, tokenize=False, add_generation_prompt=generation_prompt, **options
                )
            except TemplateError:
                continue  # a template that refuses these messages: llmcli's own fallback differs
            got = render_chat(ours, messages, generation_prompt, **options)
            assert got == expected, (options, generation_prompt)


def test_tokenizers_it_cannot_read_exactly_are_refused_with_the_reason(
    tokenizer_folder: Path, tmp_path: Path
) -> None:
    from llmcli.models.lean_config import LeanUnsupported
    from llmcli.models.lean_tokenizer import LeanTokenizer

    config = json.loads((tokenizer_folder / "tokenizer_config.json").read_text())
    ordinary = next(iter(json.loads((tokenizer_folder / "tokenizer.json").read_text())["model"]["vocab"]))
    if ordinary.startswith("<"):  # the byte tokens of a Llama-style vocabulary come first
        ordinary = "the"
    for change, reason in (
        ({"tokenizer_class": "LlamaTokenizer"}, "tokenizer class LlamaTokenizer"),
        # in the vocabulary but not an added token: transformers would add it, and split around it
        ({"bos_token": ordinary}, f"'{ordinary}', which tokenizer.json does not add"),
        ({"add_bos_token": True}, "add_bos_token"),
        ({"bos_token": "<|not-in-the-vocabulary|>"}, "'<|not-in-the-vocabulary|>'"),
    ):
        folder = tmp_path / reason.replace(" ", "-").replace("'", "").replace("|", "")
        folder.mkdir()
        (folder / "tokenizer.json").write_text((tokenizer_folder / "tokenizer.json").read_text())
        (folder / "tokenizer_config.json").write_text(json.dumps(config | change))
        with pytest.raises(LeanUnsupported, match=reason.replace("|", r"\|")):
            LeanTokenizer(folder)


LEAN_CASES = [
    name
    for name in CASES
    if name.startswith(("llama", "mistral", "qwen2", "qwen3-", "phi", "gemma", "mixtral", "gpt-oss"))
]
LINEAR_ROPE = {"rope_parameters": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}}
# Phi-3.5-style longrope, partial: the native engine's context of 64 is past the original 16,
# so both models run on the long factors.
LONGROPE = {
    "rope_parameters": {
        "rope_type": "longrope", "rope_theta": 1e4, "partial_rotary_factor": 0.75,
        "short_factor": [1.0 + 0.1 * i for i in range(6)], "long_factor": [2.0 + 0.5 * i for i in range(6)],
        "original_max_position_embeddings": 16,
    },
    "original_max_position_embeddings": 16,
    **PHI,
}  # fmt: skip
EXTRA_CASES = {"llama-linear-rope": ("llama", LINEAR_ROPE), "phi3-longrope": ("phi3", LONGROPE)}


@pytest.mark.parametrize("case", [*LEAN_CASES, *EXTRA_CASES])
def test_a_lean_model_computes_what_transformers_loaded_one_does(case: str, tmp_path: Path) -> None:
    """Built from the saved safetensors without transformers: the same RoPE table and, through
    the native engine, the same fp32 logits after a prefill and at each decode step."""
    from llmcli.engine.native.backend import NativeBackend
    from llmcli.models.lean_config import LeanConfig
    from llmcli.models.lean_model import Tensors
    from llmcli.models.lean_model import build as build_lean

    arch, overrides = EXTRA_CASES.get(case) or CASES[case]
    reference = build(arch, overrides)
    reference.save_pretrained(tmp_path)
    config = LeanConfig(json.loads((tmp_path / "config.json").read_text()))
    lean = build_lean(Tensors(tmp_path, torch.float32, torch.device("cpu")), config)
    names = ("inv_freq", "full_attention_inv_freq", "sliding_attention_inv_freq")  # Gemma 3: per kind
    tables = [name for name in names if hasattr(reference.model.rotary_emb, name)]
    assert tables
    for name in tables:
        ours, theirs = (getattr(model.model.rotary_emb, name) for model in (lean, reference))
        torch.testing.assert_close(ours, theirs.float(), rtol=0, atol=0)
    prompt = torch.randint(0, BASE["vocab_size"], (12,), generator=torch.Generator().manual_seed(1)).tolist()
    engines = [NativeBackend(model, 64) for model in (reference, lean)]
    logits = [engine.prefill(prompt) for engine in engines]
    torch.testing.assert_close(logits[1], logits[0], rtol=0, atol=0)
    token = torch.tensor([int(logits[0].argmax())])
    for _ in range(4):
        steps = [engine.decode(token) for engine in engines]
        torch.testing.assert_close(steps[1], steps[0], rtol=0, atol=0)
        token = torch.tensor([int(steps[0].argmax())])


@pytest.fixture(scope="module")
def lean_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("models") / "lean-llama", "llama")


def copy_of(model: Path, folder: Path) -> Path:
    """A copy of a model folder, to change a file of."""
    shutil.copytree(model, folder)
    return folder


def test_a_one_shot_call_on_the_native_path_imports_neither_transformers_nor_accelerate(
    lean_llama: Path,
) -> None:
    args = ["generate", "-m", str(lean_llama), "-t", "0", "-n", "8", "The capital of France"]
    result = run_reporting_imports(*args)
    assert "exit 0 imported -" in result.stderr, result.stderr
    assert result.stdout.strip()
    # Beam search needs transformers' model: that call loads through transformers, no note said.
    beams = run_cli(*args, "--num-beams", "2")
    assert beams.returncode == 0 and b"lean loader" not in beams.stderr, beams.stderr


@pytest.mark.parametrize("length", [None, 16, 17, 64])
def test_longrope_frequencies_are_transformers_own(length: int | None, tmp_path: Path) -> None:
    """llmcli's LongRoPE table (lean_config.longrope_frequencies), from transformers' config or
    from config.json alone, is transformers' own for a text of `length`: the short factors up to
    the pretraining length of 16, the long ones past it, and the same attention scaling."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from llmcli.models.lean_config import LeanConfig, longrope_frequencies

    reference = build("phi3", LONGROPE)
    reference.save_pretrained(tmp_path)
    lean_config = LeanConfig(json.loads((tmp_path / "config.json").read_text()))
    expected, scale = ROPE_INIT_FUNCTIONS["longrope"](reference.config, torch.device("cpu"), seq_len=length)
    for config in (reference.config, lean_config):
        inv_freq, ours = longrope_frequencies(config, length)
        torch.testing.assert_close(inv_freq, expected, rtol=0, atol=0)
        assert ours == scale and scale > 1


def test_a_gemma3_config_of_any_age_is_read_as_transformers_reads_it(tmp_path: Path) -> None:
    """A Gemma 3 config.json as the Hub's checkpoints write it (before transformers 5: a layer
    pattern, a local RoPE base, the global scaling apart) and as transformers 5 writes it: the
    lean config settles the same layer kinds and RoPE parameters as transformers' own."""
    from transformers import AutoConfig

    from llmcli.models.lean_config import LeanConfig

    hub = {
        "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 8, "num_attention_heads": 4, "num_key_value_heads": 1,
        "head_dim": 16, "vocab_size": 300, "rope_theta": 1_000_000.0, "rope_local_base_freq": 10_000.0,
        "rope_scaling": {"factor": 8.0, "rope_type": "linear"}, "sliding_window_pattern": 6,
        "sliding_window": 512, "query_pre_attn_scalar": 16,
    }  # fmt: skip
    for name, values in (("hub", hub), ("saved", None)):
        folder = tmp_path / name
        folder.mkdir()
        if values is None:  # the same model saved by transformers 5
            AutoConfig.for_model(**{k: v for k, v in hub.items() if k != "architectures"}).save_pretrained(
                folder
            )
            values = json.loads((folder / "config.json").read_text()) | {
                "architectures": hub["architectures"]
            }
        (folder / "config.json").write_text(json.dumps(values))
        theirs, ours = AutoConfig.from_pretrained(folder), LeanConfig(values)
        assert ours.layer_types == theirs.layer_types and "full_attention" in ours.layer_types
        for kind, rope in theirs.rope_parameters.items():
            assert {key: ours.rope_parameters[kind].get(key) for key in rope} == rope, (name, kind)


def test_a_gemma2_hub_config_is_read_as_transformers_reads_it(tmp_path: Path) -> None:
    """Gemma 2's config.json as the Hub writes it (no layer kinds, soft caps left to defaults):
    the same layer kinds, caps and RoPE as transformers' own reading."""
    from transformers import AutoConfig

    from llmcli.models.lean_config import LeanConfig, rope_frequencies

    hub = {
        "architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2", "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 5, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16, "vocab_size": 300, "rope_theta": 10000.0, "query_pre_attn_scalar": 16,
    }  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(hub))
    theirs, ours = AutoConfig.from_pretrained(tmp_path), LeanConfig(hub)
    assert ours.layer_types == theirs.layer_types and len(set(ours.layer_types)) == 2
    for name in ("final_logit_softcapping", "attn_logit_softcapping", "sliding_window", "head_dim"):
        assert getattr(ours, name) == getattr(theirs, name), name
    from transformers.models.gemma2.modeling_gemma2 import Gemma2RotaryEmbedding

    torch.testing.assert_close(
        rope_frequencies(ours)[0], Gemma2RotaryEmbedding(theirs).inv_freq, rtol=0, atol=0
    )


@pytest.mark.parametrize("arch", ["gemma3_text", "qwen3_moe", "gpt_oss"])
def test_gemma3_and_a_mixture_of_experts_take_the_lean_path(arch: str, tmp_path: Path) -> None:
    """Gemma 3's text model, Qwen3-MoE's experts restacked from one tensor each as transformers
    holds them, and gpt-oss (sinks, YaRN, experts stored stacked), load without transformers and
    reply as transformers' path does."""
    folder = build_tiny_model(tmp_path / arch, arch)
    args = ["generate", "-m", str(folder), "-t", "0", "-n", "8", "--json", "The capital of France"]
    lean = run_reporting_imports(*args)
    assert "exit 0 imported -" in lean.stderr and "lean loader" not in lean.stderr, lean.stderr
    reference = run_cli(*args, "--engine", "transformers")
    assert reference.returncode == 0, reference.stderr
    assert json.loads(lean.stdout)["text"] == json.loads(reference.stdout)["text"]


def test_a_phi3_folder_takes_the_lean_path_with_its_long_context_rope(tmp_path: Path) -> None:
    """Phi-3's fused q/k/v and gate/up are read as stored, and its long-context RoPE (longrope:
    Phi-3.5, Phi-4-mini) computed by llmcli: no transformers imported, either way."""
    folder = build_tiny_model(tmp_path / "phi3", "phi3")
    args = ["generate", "-m", str(folder), "-t", "0", "-n", "8", "The capital of France"]
    config = json.loads((folder / "config.json").read_text())
    half = config["hidden_size"] // config["num_attention_heads"] // 2
    longrope = {
        "rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 64,
        "short_factor": [1.0] * half, "long_factor": [2.0] * half,
    }  # fmt: skip
    for rope in (None, longrope):
        (folder / "config.json").write_text(json.dumps(config | {"rope_parameters": rope}))
        result = run_reporting_imports(*args)
        assert "exit 0 imported -" in result.stderr and "lean loader" not in result.stderr, result.stderr
        assert result.stdout.strip()


def test_a_native_family_the_lean_path_cannot_read_loads_through_transformers_with_a_note(
    lean_llama: Path, tmp_path: Path
) -> None:
    folder = copy_of(lean_llama, tmp_path / "llama-tokenizer-class")
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps(config | {"add_bos_token": False}))
    result = run_cli("generate", "-m", str(folder), "-t", "0", "-n", "4", "Hello")
    assert result.returncode == 0, result.stderr
    notes = [line for line in result.stderr.decode().splitlines() if "lean loader" in line]
    assert len(notes) == 1 and "add_bos_token" in notes[0], result.stderr


@pytest.fixture(scope="module")
def llama2_style(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Llama 2-shaped folder: a Metaspace, byte-fallback tokenizer of the LlamaTokenizer class
    (which transformers 5 builds in code from the vocabulary), with an add_bos_token switch."""
    models = tmp_path_factory.mktemp("models")
    folder = build_tiny_model(models / "llama2-style", "llama", tokenizer_style="metaspace")
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config |= {"tokenizer_class": "LlamaTokenizer", "add_bos_token": True, "bos_token": "<|endoftext|>"}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def test_a_tokenizer_transformers_builds_in_code_is_kept_and_later_starts_are_lean(
    llama2_style: Path, tmp_path: Path
) -> None:
    """The first start reads a LlamaTokenizer folder through transformers (one note says so),
    and keeps the tokenizer transformers built; the next starts read that through `tokenizers`
    alone — no transformers imported — with the same reply, and it answers as transformers'."""
    from transformers import AutoTokenizer

    from llmcli.models.lean_tokenizer import LeanTokenizer
    from llmcli.models.tokenizer_capture import captured

    env = {"XDG_CACHE_HOME": str(tmp_path / "cache")}
    args = ["generate", "-m", str(llama2_style), "-t", "0", "-n", "8", "The capital of France"]
    first = run_cli(*args, env=env)
    assert first.returncode == 0, first.stderr
    notes = first.stderr.decode().strip().splitlines()
    assert len(notes) == 1 and "LlamaTokenizer" in notes[0] and "later starts are lean" in notes[0], notes
    again = run_reporting_imports(*args, env=env)
    assert "exit 0 imported -" in again.stderr and "lean loader" not in again.stderr, again.stderr
    assert again.stdout == first.stdout.decode()
    monkeypatch = pytest.MonkeyPatch()
    with monkeypatch.context() as patch:
        patch.setenv("XDG_CACHE_HOME", env["XDG_CACHE_HOME"])
        kept = captured(llama2_style)
    assert kept is not None
    lean, reference = LeanTokenizer(kept), AutoTokenizer.from_pretrained(llama2_style)
    texts = ["Hello world", "  two  spaces", "café 東京 🙂\n\nx", "<|im_start|>user\nhi<|im_end|>", ""]
    for text in texts:
        for special in (True, False):
            ids = reference.encode(text, add_special_tokens=special)
            assert lean.encode(text, add_special_tokens=special) == ids, (text, special)
            assert lean.decode(ids) == reference.decode(ids)
    # What the class built is not what the folder's tokenizer.json says, read as it stands.
    as_written = json.loads((llama2_style / "tokenizer.json").read_text())
    assert json.loads((kept / "tokenizer.json").read_text())["normalizer"] != as_written["normalizer"]


def test_a_kept_tokenizer_must_answer_as_transformers_does(
    llama2_style: Path, lean_llama: Path, tmp_path: Path
) -> None:
    """What transformers built is kept only if llmcli's lean tokenizer reads it back alike: the
    check tells two different tokenizers apart."""
    from transformers import AutoTokenizer

    from llmcli.models.lean_tokenizer import LeanTokenizer
    from llmcli.models.tokenizer_capture import same_answers, write_plain

    reference = AutoTokenizer.from_pretrained(llama2_style)
    assert write_plain(reference, tmp_path / "kept")
    assert same_answers(LeanTokenizer(tmp_path / "kept"), reference)
    assert not same_answers(LeanTokenizer(lean_llama), reference)


def test_tensor_file_reads_each_tensor_as_safetensors_does(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    from llmcli.errors import ModelLoadError
    from llmcli.models.tensor_file import TensorFile

    generator = torch.Generator().manual_seed(0)
    tensors = {
        "f32": torch.randn(3, 5, generator=generator),
        "bf16": torch.randn(7, generator=generator).to(torch.bfloat16),
        "f16": torch.randn(2, 2, 2, generator=generator).to(torch.float16),
        "u8": torch.randint(0, 255, (9,), generator=generator, dtype=torch.uint8),
        "i32": torch.randint(-5, 5, (4, 1), generator=generator, dtype=torch.int32),
    }
    path = tmp_path / "tensors.safetensors"
    save_file(tensors, str(path))
    file, expected = TensorFile(path), load_file(str(path))
    assert sorted(file.keys()) == sorted(expected)
    for name, tensor in expected.items():
        got = file.get(name)
        assert got.dtype == tensor.dtype and torch.equal(got, tensor), name
        assert got.data_ptr() % 64 == 0  # aligned as torch aligns its own tensors
    path.write_bytes(path.read_bytes()[:-8])  # cut short: named, not crashed on
    with pytest.raises(ModelLoadError, match="damaged"):
        TensorFile(path)


def test_a_checkpoint_missing_a_tensor_is_refused_in_one_line_naming_it(
    lean_llama: Path, tmp_path: Path
) -> None:
    from safetensors.torch import load_file, save_file

    folder = copy_of(lean_llama, tmp_path / "no-head")
    tensors = load_file(str(folder / "model.safetensors"))
    del tensors["model.layers.1.mlp.down_proj.weight"]
    save_file(tensors, str(folder / "model.safetensors"))
    line = one_error_line(run_cli("generate", "-m", str(folder), "-n", "2", "Hello"), 1)
    assert "model.layers.1.mlp.down_proj.weight" in line


IMPLIED = {  # a tensor beyond the weights that the architecture's config implies
    "qwen2": "model.layers.1.self_attn.q_proj.bias",  # Qwen2's q/k/v always have biases
    "gpt_oss": "model.layers.1.self_attn.sinks",
    "qwen3_moe": "model.layers.1.self_attn.q_norm.weight",
    "gemma3_text": "model.layers.0.post_feedforward_layernorm.weight",
}


@pytest.mark.parametrize("arch", IMPLIED)
def test_a_checkpoint_without_a_tensor_its_config_implies_is_not_read_without_it(
    arch: str, tmp_path: Path
) -> None:
    """A bias, a q/k norm, Gemma's norms around the MLP, gpt-oss's sinks: read where present
    once, the lean loader ran a checkpoint missing one as a model without it. It is damaged:
    the lean loader leaves it to transformers' path, which refuses it in one line naming it.
    One the config does not imply is not read, as transformers leaves it unused."""
    from safetensors.torch import load_file, save_file

    from llmcli.models.lean_config import DamagedCheckpoint, LeanConfig
    from llmcli.models.lean_model import Tensors
    from llmcli.models.lean_model import build as build_lean

    folder = build_tiny_model(tmp_path / arch, arch)
    config = LeanConfig(json.loads((folder / "config.json").read_text()))
    build_lean(Tensors(folder, torch.float32, torch.device("cpu")), config)  # whole, it loads
    tensors = load_file(str(folder / "model.safetensors"))
    implied = tensors.pop(IMPLIED[arch])
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(DamagedCheckpoint, match=IMPLIED[arch]):
        build_lean(Tensors(folder, torch.float32, torch.device("cpu")), config)
    if arch == "gpt_oss":
        line = one_error_line(run_cli("generate", "-m", str(folder), "--device", "cpu", "-n", "2", "Hi"), 1)
        assert IMPLIED[arch] in line, line
    # A tensor its config does not imply is left unused, as transformers' modules leave it:
    # gpt-oss has every attention bias but no q/k norms; the others no output bias here.
    unused, size = (
        ("model.layers.0.self_attn.q_norm.weight", config.head_dim)
        if arch == "gpt_oss"
        else ("model.layers.0.self_attn.o_proj.bias", config.hidden_size)
    )
    tensors |= {IMPLIED[arch]: implied, unused: torch.ones(size)}
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    lean = build_lean(Tensors(folder, torch.float32, torch.device("cpu")), config)
    assert unused not in dict(lean.named_parameters())


def test_a_config_the_lean_path_cannot_read_loads_through_transformers_with_a_note(
    lean_llama: Path, tmp_path: Path
) -> None:
    """A RoPE type the lean path does not compute loads through transformers, said once; one
    neither path can read (a llama3 RoPE missing parameters) is one error line, no note."""

    def with_rope(name: str, rope: dict) -> Path:
        folder = copy_of(lean_llama, tmp_path / name)
        config = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps(config | {"rope_parameters": rope}))
        return folder

    dynamic = with_rope("dynamic", {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0})
    result = run_cli("generate", "-m", str(dynamic), "-t", "0", "-n", "4", "Hello")
    assert result.returncode == 0, result.stderr
    notes = [line for line in result.stderr.decode().splitlines() if "lean loader" in line]
    assert len(notes) == 1 and "RoPE type 'dynamic'" in notes[0], result.stderr
    broken = with_rope("llama3-incomplete", {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0})
    line = one_error_line(run_cli("generate", "-m", str(broken), "-n", "2", "Hello"), 1)
    assert "low_freq_factor" in line or "high_freq_factor" in line


YARN = {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0, "original_max_position_embeddings": 16}
YARN_CASES = {
    "gpt-oss-defaults": ("gpt_oss", {}),  # GptOssConfig's own YaRN, none written in config.json
    "gpt-oss-untruncated": ("gpt_oss", {"rope_parameters": YARN | {"truncate": False, "beta_slow": 1.0}}),
    # the older form Qwen's long-context configs write: rope_scaling with "type", rope_theta apart
    "qwen3-rope-scaling": ("qwen3", {"rope_scaling": {"type": "yarn", "factor": 4.0}, "rope_theta": 1e6}),
    "qwen2-mscale": ("qwen2", {"rope_parameters": YARN | {"mscale": 0.707, "mscale_all_dim": 1.0}}),
    "llama-attention-factor-head-dim-32": (
        "llama",
        {"rope_parameters": YARN | {"attention_factor": 1.3, "beta_fast": 16.0}, "head_dim": 32},
    ),
}


@pytest.mark.parametrize("case", YARN_CASES)
def test_yarn_frequencies_are_transformers_own(case: str, tmp_path: Path) -> None:
    """llmcli's YaRN table (gpt-oss, Qwen's long-context configs), from config.json as written by
    hand and as transformers saves it, is transformers' own: the same frequencies bit for bit
    and the same attention scaling."""
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from llmcli.models.lean_config import LeanConfig, rope_frequencies

    arch, overrides = YARN_CASES[case]
    # No head_dim: each family's default (gpt-oss 64, Qwen3 128, the others hidden / heads).
    shape = {k: v for k, v in BASE.items() if k != "initializer_range"} | overrides
    written = shape | {"architectures": [ARCHITECTURES[arch]]}
    theirs = AutoConfig.for_model(arch, **shape)
    theirs.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text()) | {"architectures": written["architectures"]}
    expected, scale = ROPE_INIT_FUNCTIONS["yarn"](theirs, torch.device("cpu"))
    for values in (written, saved):
        inv_freq, ours = rope_frequencies(LeanConfig(values))
        torch.testing.assert_close(inv_freq, expected, rtol=0, atol=0)
        assert ours == scale


ARCHITECTURES = {
    "gpt_oss": "GptOssForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "llama": "LlamaForCausalLM",
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_gpt_oss_mxfp4_experts_read_by_llmcli_are_transformers_own(
    dtype: torch.dtype, tmp_path: Path
) -> None:
    """A gpt-oss checkpoint with MXFP4 experts, built by the lean loader: every tensor equal to
    what transformers' loader dequantizes, in its dtype (the norms fp32 in an fp16 model, as
    transformers keeps them)."""
    from transformers import AutoModelForCausalLM, Mxfp4Config

    from llmcli.models.lean_config import LeanConfig
    from llmcli.models.lean_model import Tensors
    from llmcli.models.lean_model import build as build_lean

    folder = mxfp4_experts(build_tiny_model(tmp_path / "gpt-oss", "gpt_oss"))
    reference = AutoModelForCausalLM.from_pretrained(
        folder, dtype=dtype, quantization_config=Mxfp4Config(dequantize=True)
    )
    config = LeanConfig(json.loads((folder / "config.json").read_text()))
    lean = build_lean(Tensors(folder, dtype, torch.device("cpu")), config)
    theirs, ours = dict(reference.named_parameters()), dict(lean.named_parameters())
    assert set(ours) == set(theirs)
    for name, tensor in theirs.items():
        assert ours[name].dtype == tensor.dtype and torch.equal(ours[name], tensor), name
    norms = torch.bfloat16 if dtype == torch.bfloat16 else torch.float32
    assert ours["model.norm.weight"].dtype == norms
    assert ours["model.layers.0.mlp.experts.down_proj"].dtype == dtype


def test_mxfp4_blocks_that_do_not_match_their_scales_are_refused_in_one_line(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    folder = mxfp4_experts(build_tiny_model(tmp_path / "gpt-oss", "gpt_oss"))
    tensors = load_file(str(folder / "model.safetensors"))
    name = "model.layers.1.mlp.experts.down_proj_scales"
    tensors[name] = tensors[name][:, :, :1].contiguous()
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    line = one_error_line(run_cli("generate", "-m", str(folder), "--device", "cpu", "-n", "2", "Hi"), 1)
    assert "model.layers.1.mlp.experts.down_proj_blocks" in line and "do not match" in line, line
