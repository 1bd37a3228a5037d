"""Where llama.cpp's GGUF fixtures are, and what a test says when they are not there.

They are not in the repository (35 files, 66 MB: fifteen GGUF files of one small random Llama,
each written by llama.cpp itself, with llama.cpp's own logits on each); the project keeps them
beside the checkout, in ../shared/gguf-fixtures, with a README saying how they were made.
LLMCLI_GGUF_FIXTURES names another folder. Without them, the tests that hold llmcli's reading
of GGUF files to llama.cpp's own outputs skip, each saying why (README.md, Development)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

FIXTURES = Path(
    os.environ.get("LLMCLI_GGUF_FIXTURES") or Path(__file__).resolve().parents[2] / "shared" / "gguf-fixtures"
)
MISSING = (
    f"llama.cpp's GGUF fixtures are not at {FIXTURES}: they are not in the repository (see README.md, "
    "Development; LLMCLI_GGUF_FIXTURES names their folder), so llmcli's GGUF reading is not held "
    "to llama.cpp's own outputs here"
)


def fixture(name: str) -> Path:
    """fixture-NAME.gguf, or a skip that says where it was looked for and what goes unchecked."""
    path = FIXTURES / f"fixture-{name}.gguf"
    if not path.is_file():
        pytest.skip(MISSING)
    return path
