"""A GGUF file's byte-level BPE tokenizer written as tokenizer.json and tokenizer_config.json,
through `tokenizers` alone.

A GGUF file keeps its tokenizer as metadata: the vocabulary, the merges, each token's type, the
special tokens' ids and the name of its pre-tokenizer. transformers' GGUF conversion builds a
tokenizer from those, but it needs transformers imported and its config machinery run (about
4 s of the demo's first load, measured, against 0.3 s here). This builds the same tokenizer for
the byte-level BPE files (`tokenizer.ggml.model` = "gpt2": Llama 3, Qwen2/3, SmolLM, Mistral's
Tekken) — the tests hold it equal to transformers' conversion, and to llama.cpp's own token ids on
its fixtures — and answers None for every other kind (sentencepiece, unigram, Gemma's), which
goes through transformers' conversion as before.

Where it parts from transformers on purpose: transformers' GPT-2 class adds "<|endoftext|>" to a
vocabulary without it (Llama 3's), one id past the model's embedding table; that token is not
added here, so the vocabulary is the file's.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from llmcli.errors import ModelLoadError
from llmcli.models.gguf_table import GGUFTable, read_arrays

TOKENS, MERGES, TOKEN_TYPES = "tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type"
CONTROL, USER_DEFINED = 3, 4  # llama.cpp's token types
# transformers' named special tokens and the GGUF keys of their ids.
_SPECIAL_IDS = {
    "bos_token": "tokenizer.ggml.bos_token_id",
    "eos_token": "tokenizer.ggml.eos_token_id",
    "unk_token": "tokenizer.ggml.unknown_token_id",
    "pad_token": "tokenizer.ggml.padding_token_id",
}

# How llama.cpp's pre-tokenizers (`tokenizer.ggml.pre`) split text before the merges, as the
# regular expressions transformers' conversion uses for them; any other name keeps GPT-2's split.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"""
    r"""\s*[\r\n]+|\s+(?!\S)|\s+"""
)
_QWEN35_SPLIT = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|"""
    r"""\s*[\r\n]+|\s+(?!\S)|\s+"""
)
_TEKKEN_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_LLAMA3_NAMES = (
    "llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2",
    "jina-v5-nano", "dbrx", "smaug-bpe",
)  # fmt: skip
SPLITS = {
    **dict.fromkeys(_LLAMA3_NAMES, _LLAMA3_SPLIT),
    "tekken": _TEKKEN_SPLIT,
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez"), _QWEN2_SPLIT),
    "qwen35": _QWEN35_SPLIT,
    **dict.fromkeys(("gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"), _GPT4O_SPLIT),
}


def builds(table: GGUFTable) -> bool:
    """Whether this module builds the file's tokenizer: byte-level BPE with its merges listed."""
    metadata = table.metadata
    return metadata.get("tokenizer.ggml.model") == "gpt2" and TOKENS in metadata and MERGES in metadata


def write_tokenizer(table: GGUFTable, folder: Path) -> None:
    """tokenizer.json, tokenizer_config.json and chat_template.jinja in `folder`, as
    transformers saves the tokenizer it converts from the file (for a file `builds` takes)."""
    metadata = read_arrays(table.path, frozenset({TOKENS, MERGES, TOKEN_TYPES}))
    tokens, merges = metadata[TOKENS], metadata[MERGES]
    if not all(
        isinstance(value, list) and all(isinstance(s, str) for s in value) for value in (tokens, merges)
    ):
        raise ModelLoadError(f"{table.path}: its tokenizer's vocabulary or merges are not lists of strings")
    named = {name: _token_at(tokens, metadata.get(key)) for name, key in _SPECIAL_IDS.items()}
    try:
        tokenizer = _byte_level(tokens, merges, metadata.get(TOKEN_TYPES) or [], named)
    except Exception as error:  # tokenizers' own, for a merge of tokens the vocabulary lacks, say
        raise ModelLoadError(f"{table.path}: cannot build its tokenizer ({error})") from None
    split = SPLITS.get(str(metadata.get("tokenizer.ggml.pre")))
    if split is not None:
        from tokenizers import Regex, pre_tokenizers

        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    tokenizer.post_processor = _post_processor(
        tokenizer,
        named["bos_token"] if metadata.get("tokenizer.ggml.add_bos_token") else None,
        named["eos_token"] if metadata.get("tokenizer.ggml.add_eos_token") else None,
    )
    tokenizer.save(str(folder / "tokenizer.json"))
    config = {"backend": "tokenizers", **named, "tokenizer_class": "TokenizersBackend"}
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    template = metadata.get("tokenizer.chat_template")
    if isinstance(template, str):
        (folder / "chat_template.jinja").write_text(template, encoding="utf-8")


def _token_at(tokens: list[str], index: Any) -> str | None:
    return tokens[index] if isinstance(index, int) and 0 <= index < len(tokens) else None


def _byte_level(tokens: list[str], merges: list[str], types: list[int], named: dict[str, str | None]) -> Any:
    """GPT-2's byte-level BPE over the file's vocabulary and merges, its control tokens (and the
    named special ones) added as special, its user-defined ones (`<think>`) as plain added tokens:
    each is matched whole in the text, as llama.cpp matches it."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    spelling = _byte_spelling()
    letters = set(spelling.values())
    # A token written outside the byte alphabet (a raw space, say) is spelled in it, as the merges are.
    vocab = {
        token if set(token) <= letters else "".join(spelling[b] for b in token.encode("utf-8")): index
        for index, token in enumerate(tokens)
    }
    pairs = [tuple(merge.split(" ")) for merge in merges]
    tokenizer = Tokenizer(
        models.BPE(
            vocab=vocab,
            merges=pairs,
            dropout=None,
            continuing_subword_prefix="",
            end_of_word_suffix="",
            fuse_unk=False,
        )
    )
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    # A control token spelled outside the byte alphabet is one llama.cpp mislabelled: it is left
    # as the vocabulary has it rather than pushing the vocabulary past the model's embedding.
    typed = list(zip(tokens, types, strict=False))  # a file without token types has none of these
    control = [t for t, kind in typed if kind == CONTROL and set(t) <= letters]
    specials = list(dict.fromkeys([*control, *(t for t in named.values() if t is not None)]))
    tokenizer.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in specials])
    user = [t for t, kind in typed if kind == USER_DEFINED and t in vocab]
    tokenizer.add_tokens([AddedToken(t, normalized=False, special=False) for t in user])
    return tokenizer


def _byte_spelling() -> dict[int, str]:
    """GPT-2's byte alphabet: each printable byte stands for itself, the others for the
    characters from U+0100 on, in byte order (the alphabet byte-level vocabularies are written in)."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]  # "!"…"~", "¡"…"¬", "®"…"ÿ"
    others = [b for b in range(256) if b not in printable]
    return {b: chr(b) for b in printable} | {b: chr(256 + n) for n, b in enumerate(others)}


def _post_processor(tokenizer: Any, bos: str | None, eos: str | None) -> Any:
    """BOS and EOS added around each sequence as the file asks (`add_bos_token`/`add_eos_token`),
    in transformers' template form."""
    from tokenizers import processors

    single = " ".join([*([f"{bos}:0"] if bos else []), "$A:0", *([f"{eos}:0"] if eos else [])])
    pair = " ".join([single, *([f"{bos}:1"] if bos else []), "$B:1", *([f"{eos}:1"] if eos else [])])
    specials = [(token, tokenizer.token_to_id(token)) for token in (bos, eos) if token]
    return processors.TemplateProcessing(single=single, pair=pair, special_tokens=specials)
