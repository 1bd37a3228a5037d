"""JSON schemas into llguidance grammars, and the per-tokenizer state it needs, made once.

Compiled grammars are cached by schema text (a chat or a server sees the same schema again);
llguidance's view of a tokenizer costs about 0.6 s to build for a 49k vocabulary (1.3 s for
128k), so it is made once per tokenizer and process: a chat or a server pays it once.
"""

from __future__ import annotations

import copy
import functools
import weakref
from typing import TYPE_CHECKING, Any

from llmcli.errors import LlmcliError, UsageError

if TYPE_CHECKING:
    from llmcli.engine.structured import OutputFormat

# No free whitespace between tokens, so a model (a random one above all) cannot spend its whole
# budget on spaces and newlines inside a value; but JSON's usual ", " and ": " between items, as
# models saw it written. Compact separators put a model off what it learnt: on the demo, 6 of 8
# sampled extractions (--format json) nested every field under the first key or never ended,
# against 0 of 8 with the spaces (docs/benchmarks.md).
COMPILE_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
ENDLESS = "no finite JSON value satisfies it (it nests in itself with no way out): a reply could not end"


def _llguidance() -> Any:
    try:
        import llguidance
    except ImportError:  # pragma: no cover - a dependency; only a broken install lacks it
        raise LlmcliError(
            "constrained decoding needs llguidance, which is not installed",
            "pip install llguidance",
        ) from None
    return llguidance


@functools.lru_cache(maxsize=64)
def _compiled(schema_text: str) -> tuple[str, str]:
    """(grammar, error): error is '' when the schema compiles."""
    matcher = _llguidance().LLMatcher
    try:
        grammar = matcher.grammar_from_json_schema(schema_text, defaults=COMPILE_OPTIONS)
    except ValueError as error:
        return "", str(error)
    return grammar, matcher.validate_grammar(grammar)


@functools.lru_cache(maxsize=64)
def _compiled_lark(lark: str) -> tuple[str, str]:
    matcher = _llguidance().LLMatcher
    try:
        grammar = matcher.grammar_from_lark(lark)
    except ValueError as error:
        return "", str(error)
    return grammar, matcher.validate_grammar(grammar)


def check_format(output: OutputFormat) -> str:
    """The grammar for `output`; an invalid or unsatisfiable schema is one UsageError line."""
    grammar, error = _compiled_lark(output.lark) if output.lark else _compiled(output.schema_text)
    if not error and not output.lark and not _finishes(output.schema_text):
        error = ENDLESS
    if error:
        message = " ".join(error.split())
        raise UsageError(
            f"{output.label}: {_plain(message)}", "check the grammar" if output.lark else "check the schema"
        )
    return grammar


@functools.lru_cache(maxsize=64)
def _finishes(schema_text: str) -> bool:
    import json

    from llmcli.engine.structured.finite import can_finish

    return can_finish(json.loads(schema_text))


def _plain(message: str) -> str:
    """llguidance's message, first line only, without its internal prefixes."""
    return message.split(" at ")[0] if len(message) > 200 else message


_tokenizers: weakref.WeakKeyDictionary[Any, dict[Any, Any]] = weakref.WeakKeyDictionary()


def guidance_tokenizer(tokenizer: Any, vocab_size: int, eos_token_ids: frozenset[int]) -> Any:
    """llguidance's view of a fast tokenizer (transformers' or llmcli's lean one: both hold the
    `tokenizers` object), sized to the model's logits. Built from that object's JSON as
    `llguidance.hf.from_tokenizer` builds it, without the transformers import that module makes."""
    from llguidance import LLTokenizer

    key = (vocab_size, tuple(sorted(eos_token_ids)))
    per_tokenizer = _tokenizers.setdefault(tokenizer, {})
    if key not in per_tokenizer:
        eos = list(key[1]) or tokenizer.eos_token_id
        backend = getattr(tokenizer, "backend_tokenizer", None)
        try:
            if backend is None:
                raise ValueError("it is not a fast tokenizer")
            backend = copy.copy(backend)
            backend.no_padding()
            backend.no_truncation()
            # JSON's slices of the vocabulary: the worst step's mask 0.26 ms instead of 4 ms (demo).
            per_tokenizer[key] = LLTokenizer(
                backend.to_str(), n_vocab=vocab_size, eos_token=eos, slices=LLTokenizer.json_slices()
            )
        except (AssertionError, ValueError, TypeError) as error:
            raise LlmcliError(
                f"this model's tokenizer cannot be used for constrained decoding ({error})"
            ) from None
    return per_tokenizer[key]
