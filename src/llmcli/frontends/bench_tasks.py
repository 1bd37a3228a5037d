"""The prompts speculative decoding is measured on: one copy-heavy task, where the reply repeats
the input (what prompt lookup is for), and free-form chat, where it must not cost anything."""

from __future__ import annotations

from pathlib import Path

# 311 words with a typo in most sentences: "fix the typos" makes the reply a near-copy.
TYPOS_PARAGRAPH = (Path(__file__).parent / "typos.txt").read_text()
COPY_TASK = ("copy: fix the typos (311 words)", f"Fix the typos in this paragraph:\n\n{TYPOS_PARAGRAPH}")
FREE_FORM = [
    ("chat: a poem", "Write a short poem about autumn leaves."),
    ("chat: explain", "Explain how a bicycle works to a child."),
    ("chat: advice", "Give me three tips for sleeping better."),
]
