"""A checkpoint's fingerprint: what a prompt's state saved on disk is keyed by, so that nothing
computed by one set of weights is ever resumed by another.

The files' identities, not their contents: hashing gigabytes of weights at every start would cost
more than the prefill a cache saves. Each file the checkpoint reads (its folder, the GGUF file
read in place) counts by its resolved path, size and modification time, so a file replaced or
rewritten is another model. A Hub snapshot's files resolve to blobs named by their content hash.
Torch-free.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from llmcli.models.checkpoint import Checkpoint


def checkpoint_fingerprint(checkpoint: Checkpoint) -> str:
    """A hex digest of the identity of every file the checkpoint's weights come from."""
    digest = hashlib.sha256()
    files = sorted(path for path in checkpoint.path.rglob("*") if path.is_file())
    if checkpoint.read_in_place and checkpoint.gguf_file is not None:
        files.append(checkpoint.gguf_file)
    for path in files:
        digest.update(_identity(path).encode())
    return digest.hexdigest()


def _identity(path: Path) -> str:
    try:
        resolved = path.resolve()
        found = resolved.stat()
    except (OSError, RuntimeError):
        return f"{path}\0missing\n"
    return f"{resolved}\0{found.st_size}\0{found.st_mtime_ns}\n"
