"""Numbers and nouns as a person writes them, for every front end's lines."""

from __future__ import annotations


def plural(count: int, noun: str, nouns: str | None = None) -> str:
    """ "1 reply", "2 replies", "0 tokens": numbers as a person writes them."""
    return f"{count} {noun if count == 1 else nouns or noun + 's'}"
