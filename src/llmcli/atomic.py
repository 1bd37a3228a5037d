"""Files that other llmcli processes may read while this one writes them: a reader sees the old
file or the whole new one, never a half-written file, and a crash mid-write leaves at most a
stray temporary file that nothing trusts."""

from __future__ import annotations

import os
from pathlib import Path


def write_text_atomically(path: Path, text: str) -> None:
    staging = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        staging.write_text(text, encoding="utf-8")
        os.replace(staging, path)
    finally:
        staging.unlink(missing_ok=True)
