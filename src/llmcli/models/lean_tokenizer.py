"""A model folder's tokenizer through `tokenizers` alone, for the native builder (build_native.py).

transformers' tokenizer classes cost half a second to import and pull in much of transformers;
what llmcli asks of a tokenizer (encode, decode, the vocabulary, the special tokens, the chat
template's source) is all in `tokenizer.json` and `tokenizer_config.json`. This class answers
those same calls, named as transformers names them, so the rest of llmcli takes either.

It reads a folder as transformers' generic fast tokenizer (`TokenizersBackend`,
`PreTrainedTokenizerFast`) reads it, and Qwen2's and GPT-2's classes as those classes rebuild it
(their own normaliser, pre-tokenizer and decoder over the file's vocabulary). Other classes with
their own construction (Llama's), `add_bos_token`/`add_eos_token` switches (which rewrite the
post-processor), special tokens the backend lacks (which transformers adds) and space clean-up on
a non-BPE model are refused with the reason (`TokenizerUnsupported`), and the loader takes
transformers' path, which keeps the tokenizer it built for later loads where this class reads
it back alike (tokenizer_capture.py): the tests hold this class equal to transformers' on every
tokenizer they build.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from llmcli.models.lean_config import TokenizerUnsupported

# The tokenizer classes read exactly as a plain tokenizer.json is (no construction of their own).
PLAIN_CLASSES = frozenset({"TokenizersBackend", "PreTrainedTokenizerFast"})
# transformers' named special tokens, in its order (all_special_tokens lists them so).
NAMED_SPECIALS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
CHAT_TEMPLATE_FILE = "chat_template.jinja"
CHAT_TEMPLATES_FILE = "chat_template.json"


def _content(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


class LeanTokenizer:
    def __init__(self, folder: Path) -> None:
        from tokenizers import Tokenizer

        config = _read_json(folder / "tokenizer_config.json")
        tokenizer_class = config.get("tokenizer_class") or "PreTrainedTokenizerFast"
        construct = CONSTRUCTED.get(tokenizer_class)
        if tokenizer_class not in PLAIN_CLASSES and construct is None:
            raise TokenizerUnsupported(f"its tokenizer class {tokenizer_class}")
        if "add_bos_token" in config or "add_eos_token" in config:
            raise TokenizerUnsupported("its tokenizer's add_bos_token/add_eos_token switches")
        self.backend_tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
        self.backend_tokenizer.no_truncation()
        self.backend_tokenizer.no_padding()
        self.name_or_path = str(folder)
        defaults = construct(self.backend_tokenizer, config) if construct else {}
        self._named = {
            name: _content(config[name]) if name in config else defaults.get(name) for name in NAMED_SPECIALS
        }
        extra = config.get("extra_special_tokens") or config.get("additional_special_tokens") or []
        self._extra = [token for token in map(_content, extra if isinstance(extra, list) else []) if token]
        # transformers makes every special token an added one (matched whole, before the text is
        # split): one that tokenizer.json does not list as added would encode otherwise here.
        added = {token.content for token in self.backend_tokenizer.get_added_tokens_decoder().values()}
        absent = [t for t in (*self._named.values(), *self._extra) if t is not None and t not in added]
        if absent:
            raise TokenizerUnsupported(f"its special token {absent[0]!r}, which tokenizer.json does not add")
        declared = config.get("added_tokens_decoder") or {}
        missing = [_content(token) for token in declared.values() if _content(token) not in added]
        if missing:
            raise TokenizerUnsupported(f"its added token {missing[0]!r}, which tokenizer.json lacks")
        self.clean_up_tokenization_spaces = bool(config.get("clean_up_tokenization_spaces", False))
        if self.clean_up_tokenization_spaces and type(self.backend_tokenizer.model).__name__ != "BPE":
            raise TokenizerUnsupported("its tokenizer's clean_up_tokenization_spaces")
        self.chat_template = _chat_template(folder, config)

    # Special tokens ----------------------------------------------------------------------

    def __getattr__(self, name: str) -> Any:
        """bos_token, eos_token, … and their ids (`eos_token_id`), None where unset."""
        named = self.__dict__.get("_named", {})
        if name in named:
            return named[name]
        if name.endswith("_id") and name[:-3] in named:
            token = named[name[:-3]]
            return None if token is None else self.backend_tokenizer.token_to_id(token)
        raise AttributeError(name)

    @property
    def special_tokens_map(self) -> dict[str, str]:
        return {name: token for name, token in self._named.items() if token is not None}

    @property
    def all_special_tokens(self) -> list[str]:
        tokens = [token for token in self._named.values() if token is not None] + self._extra
        return list(dict.fromkeys(tokens))

    @property
    def all_special_ids(self) -> list[int]:
        return [self.backend_tokenizer.token_to_id(token) for token in self.all_special_tokens]

    @property
    def added_tokens_decoder(self) -> dict[int, Any]:
        return dict(sorted(self.backend_tokenizer.get_added_tokens_decoder().items()))

    def get_added_vocab(self) -> dict[str, int]:
        return {token.content: index for index, token in self.added_tokens_decoder.items()}

    # Encoding and decoding ---------------------------------------------------------------

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
        return {"input_ids": self.encode(text, add_special_tokens=add_special_tokens)}

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend_tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(
        self,
        ids: int | list[int],
        skip_special_tokens: bool = False,
        clean_up_tokenization_spaces: bool | None = None,
    ) -> str:
        # Clean-up is refused above for all but BPE models, for which transformers skips it.
        ids = [ids] if isinstance(ids, int) else list(ids)
        return self.backend_tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def convert_tokens_to_ids(self, tokens: str | list[str]) -> int | list[int] | None:
        if isinstance(tokens, str):
            return self.backend_tokenizer.token_to_id(tokens)
        return [self.backend_tokenizer.token_to_id(token) for token in tokens]

    def convert_ids_to_tokens(self, ids: int | list[int]) -> str | list[str] | None:
        if isinstance(ids, int):
            return self.backend_tokenizer.id_to_token(ids)
        return [self.backend_tokenizer.id_to_token(index) for index in ids]

    def get_vocab(self) -> dict[str, int]:
        return self.backend_tokenizer.get_vocab(with_added_tokens=True)

    def __len__(self) -> int:
        return self.backend_tokenizer.get_vocab_size(with_added_tokens=True)

    # The chat template ---------------------------------------------------------------------

    def get_chat_template(self, chat_template: str | None = None, tools: list[Any] | None = None) -> str:
        """The template's source, chosen as transformers chooses among named ones: `tool_use`
        when tools are given and there is one, else `default`."""
        templates = self.chat_template
        if isinstance(templates, dict):
            name = chat_template or ("tool_use" if tools and "tool_use" in templates else "default")
            if name not in templates:
                raise ValueError(f"the tokenizer has no chat template named {name!r}")
            return templates[name]
        if templates is None:
            raise ValueError("the tokenizer has no chat template")
        return templates


def _plain_bpe(backend: Any, name: str) -> None:
    """Refuse a BPE model with options a class that rebuilds it from its vocabulary would drop
    (byte fallback, an unknown token, dropout, word affixes)."""
    model = backend.model
    if type(model).__name__ != "BPE" or model.byte_fallback or model.unk_token or model.dropout:
        raise TokenizerUnsupported(f"a {name} whose tokenizer.json the class would rebuild otherwise")
    if model.fuse_unk or model.continuing_subword_prefix or model.end_of_word_suffix:
        raise TokenizerUnsupported(f"a {name} whose tokenizer.json the class would rebuild otherwise")


def _qwen2(backend: Any, config: dict[str, Any]) -> dict[str, str]:
    """Qwen2Tokenizer as transformers 5 builds it: the file's vocabulary and merges under its own
    NFC normaliser, pre-tokenizer (Qwen's split, then bytes) and byte decoder; "<|endoftext|>"
    for the special tokens its config does not name."""
    from tokenizers import Regex, decoders, normalizers, pre_tokenizers

    _plain_bpe(backend, "Qwen2Tokenizer")
    backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=bool(config.get("add_prefix_space")), use_regex=False),
        ]
    )
    backend.decoder = decoders.ByteLevel()
    return {"unk_token": "<|endoftext|>", "eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>"}


def _gpt2(backend: Any, config: dict[str, Any]) -> dict[str, str]:
    """GPT2Tokenizer as transformers 5 builds it (SmolLM2's folders name it): the file's
    vocabulary and merges with no normaliser, GPT-2's byte-level pre-tokenizer and decoder;
    "<|endoftext|>" for the unknown, BOS and EOS tokens its config does not name."""
    from tokenizers import decoders, pre_tokenizers

    _plain_bpe(backend, "GPT2Tokenizer")
    backend.normalizer = None
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=bool(config.get("add_prefix_space")))
    backend.decoder = decoders.ByteLevel()
    return {"unk_token": "<|endoftext|>", "bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>"}


# transformers' Qwen2 pre-tokenizer pattern (tokenization_qwen2.py), as Qwen's own files write it.
QWEN2_SPLIT = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"""
    r"""\s*[\r\n]+|\s+(?!\S)|\s+"""
)
# Tokenizer classes whose construction rebuilds the backend: how, with their default specials.
CONSTRUCTED = {
    "Qwen2Tokenizer": _qwen2,
    "Qwen2TokenizerFast": _qwen2,
    "GPT2Tokenizer": _gpt2,
    "GPT2TokenizerFast": _gpt2,
}


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise TokenizerUnsupported(f"its unreadable {path.name} ({error})") from None
    return value if isinstance(value, dict) else {}


def _chat_template(folder: Path, config: dict[str, Any]) -> str | dict[str, str] | None:
    """As transformers reads it: chat_template.jinja, else chat_template.json, else the config's
    `chat_template` (one string, or a list of named ones)."""
    jinja = folder / CHAT_TEMPLATE_FILE
    named = sorted((folder / "additional_chat_templates").glob("*.jinja"))
    if jinja.is_file() and named:
        default = {"default": jinja.read_text(encoding="utf-8")}
        return default | {path.stem: path.read_text(encoding="utf-8") for path in named}
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    template = _read_json(folder / CHAT_TEMPLATES_FILE).get("chat_template") or config.get("chat_template")
    if isinstance(template, list):
        return {item["name"]: item["template"] for item in template if "name" in item and "template" in item}
    return template if isinstance(template, str) else None
