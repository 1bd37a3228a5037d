"""Text too long for the context is refused before it is tokenized.

Tokenizing takes memory many times the text's size (tens of MB of text took gigabytes), so a
prompt that cannot fit is refused by its length alone: no token covers more characters than the
longest token in the vocabulary, so a text of N characters is at least N / longest tokens.
"""

from __future__ import annotations

import functools
from typing import Any

from llmcli.errors import ContextOverflowError

# Headroom over the longest token, for normalizers that fold several characters into one.
NORMALIZER_HEADROOM = 2


@functools.lru_cache(maxsize=8)
def longest_token(tokenizer: Any) -> int:
    """Characters in the longest token's text (its bytes, for byte-level vocabularies)."""
    vocab = tokenizer.get_vocab()
    return max((len(token) for token in vocab), default=1)


def refuse_unfittable(tokenizer: Any, texts: list[str], context_length: int) -> None:
    characters = sum(len(text) for text in texts)
    per_token = longest_token(tokenizer) * NORMALIZER_HEADROOM
    if characters > context_length * per_token:
        raise ContextOverflowError(
            f"the prompt is {characters} characters, at least {characters // per_token} tokens; "
            f"the context holds {context_length}",
            "give the part of the text that matters",
        )
