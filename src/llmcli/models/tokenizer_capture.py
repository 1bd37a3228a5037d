"""A tokenizer transformers had to build, kept as the plain tokenizer it built, so later loads
read it through `tokenizers` alone (lean_tokenizer.py) and never import transformers for it.

Some tokenizer classes construct their backend in code rather than read it from tokenizer.json:
LlamaTokenizer (Llama 2, Mistral, TinyLlama: a Metaspace pre-tokenizer and a byte-fallback
decoder over the file's vocabulary), `add_bos_token` switches that rewrite the post-processor,
special tokens transformers adds. Mirroring each class by hand would be exact only as far as it
was written and tested; instead, the first load that meets one goes through transformers as
before, and what transformers built — its backend, serialised, and its special tokens — is kept
in llmcli's cache. It is kept only if llmcli's lean tokenizer reads it back giving the same
answers as transformers' own object on probe texts (ids with and without special tokens,
decoded text, vocabulary, special tokens, chat template); otherwise nothing is kept and every
load stays on transformers' path, as before.

The cache entry is named by the tokenizer files it was built from (path, size, time) and the
transformers version that built it: a changed file or another transformers builds it again.
"""

from __future__ import annotations

import hashlib
import json
from importlib import metadata
from pathlib import Path
from typing import Any

from llmcli.atomic import folder_written_atomically
from llmcli.config.paths import cache_dir

# The files a tokenizer is built from (what transformers reads for one).
SOURCES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "chat_template.jinja",
    "chat_template.json",
)
PROBES = (
    "Hello world",
    " Hello  world ",
    "  two leading spaces and trailing  ",
    "In the winter of 1887, a storm broke the windows; the keeper's daughter said: \"don't\".",
    "café naïve 東京 🙂 \t tabs\n\nnew lines\r\n",
    "x",
    "",
)


def captured(folder: Path) -> Path | None:
    """The kept plain form of `folder`'s tokenizer, if a load has kept one."""
    place = _place(folder)
    return place if place is not None and (place / "tokenizer.json").is_file() else None


def capture(tokenizer: Any, folder: Path) -> bool:
    """Keep transformers' `tokenizer` of `folder` in its plain form; whether it was kept (it
    is not where llmcli's lean tokenizer would answer otherwise)."""
    place = _place(folder)
    if place is None:
        return False
    try:  # a cache that cannot be written costs later starts their speed, never this load
        with folder_written_atomically(place) as staging:
            if not write_plain(tokenizer, staging):
                raise _NotKept
        return True
    except (_NotKept, OSError):
        return False


class _NotKept(Exception):
    """What transformers built answers otherwise through the lean tokenizer: nothing is kept."""


def write_plain(tokenizer: Any, folder: Path) -> bool:
    """`tokenizer` (transformers') saved into `folder` as the plain class reads it: its built
    backend as tokenizer.json (the post-processor already adds what `add_bos_token` asked), its
    special tokens and chat template; whether llmcli's lean tokenizer then answers as it does
    (if not, `folder` holds transformers' own save, to be read by transformers)."""
    from llmcli.models.lean_config import LeanUnsupported
    from llmcli.models.lean_tokenizer import LeanTokenizer

    tokenizer.save_pretrained(folder)
    path = folder / "tokenizer_config.json"
    saved = path.read_text(encoding="utf-8")
    config = json.loads(saved)
    config["tokenizer_class"] = "TokenizersBackend"
    for switch in ("add_bos_token", "add_eos_token"):  # built into the post-processor already
        config.pop(switch, None)
    path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    try:
        lean = LeanTokenizer(folder)
        if same_answers(lean, tokenizer):
            return True
    except LeanUnsupported:
        pass
    path.write_text(saved, encoding="utf-8")
    return False


def same_answers(lean: Any, reference: Any) -> bool:
    """Whether the two tokenizers answer alike on the probe texts and each special token's
    spelling: ids (with and without special tokens), decoded text, vocabulary, special tokens."""
    if lean.get_vocab() != reference.get_vocab() or len(lean) != len(reference):
        return False
    for name in ("special_tokens_map", "all_special_tokens", "chat_template"):
        if getattr(lean, name) != getattr(reference, name):
            return False
    specials = " ".join(reference.all_special_tokens)
    for text in (*PROBES, specials, f"{specials} Hello {specials}"):
        for special in (True, False):
            ids = reference.encode(text, add_special_tokens=special)
            if lean.encode(text, add_special_tokens=special) != ids:
                return False
            for skip in (True, False):
                decoded = reference.decode(ids, skip_special_tokens=skip)
                if lean.decode(ids, skip_special_tokens=skip) != decoded:
                    return False
    return True


def _place(folder: Path) -> Path | None:
    """Where `folder`'s tokenizer is kept: named by its files and transformers' version."""
    try:
        version = metadata.version("transformers")
    except metadata.PackageNotFoundError:
        return None
    key = hashlib.sha256(f"{folder.resolve()}\n{version}\n".encode())
    for name in SOURCES:
        try:
            stat = (folder / name).stat()
        except OSError:
            continue
        key.update(f"{name} {stat.st_size} {stat.st_mtime_ns}\n".encode())
    return cache_dir() / "tokenizers" / key.hexdigest()[:20]
