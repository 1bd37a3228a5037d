"""Files and folders that other llmcli processes may read while this one writes them: a reader
sees the old one or the whole new one, never a half-written one, and a crash mid-write leaves at
most a stray temporary file or hidden staging folder that nothing trusts."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def write_text_atomically(path: Path, text: str) -> None:
    staging = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        staging.write_text(text, encoding="utf-8")
        os.replace(staging, path)
    finally:
        staging.unlink(missing_ok=True)


@contextmanager
def folder_written_atomically(target: Path) -> Iterator[Path]:
    """A hidden staging folder beside `target` (`.NAME-…`, the prefix by which a killed run's
    leftover is found) to write into: it replaces `target` whole when the block ends without an
    exception, and is removed in any case. The caller holds whatever lock keeps two writers of
    `target` apart."""
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        yield staging
        if target.exists():
            shutil.rmtree(target, ignore_errors=True)
        os.replace(staging, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
