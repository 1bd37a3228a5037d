"""This checkout and, beside it, an earlier commit checked out into a temporary worktree: the
sources a benchmark measures side by side (--baseline REV)."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@contextmanager
def checkouts(baseline: str | None, scratch: str) -> Iterator[dict[str, Path]]:
    """{"this checkout": ROOT, "baseline REV": its worktree}; the worktree is removed after."""
    sources = {"this checkout": ROOT}
    if baseline is None:
        yield sources
        return
    worktree = Path(scratch) / "baseline"
    subprocess.run(
        ["git", "-C", str(ROOT), "worktree", "add", "-q", "--detach", str(worktree), baseline], check=True
    )
    sources[f"baseline {baseline}"] = worktree
    try:
        yield sources
    finally:
        subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(worktree)], check=False)
