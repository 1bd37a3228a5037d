"""Images attached to a chat's next message: `/image PATH`, or a path pasted (or dropped from a
file manager, which pastes it quoted, escaped or as a file:// URL) alone on the line."""

from __future__ import annotations

import shlex
from pathlib import Path
from urllib.parse import unquote, urlparse

IMAGE_SUFFIXES = frozenset({".png", ".jpg", ".jpeg", ".gif", ".webp", ".bmp"})


def dropped_image_path(text: str) -> Path | None:
    """The image file a line names, where the whole line is one path to an image that exists
    (a message that merely mentions a path is a message)."""
    line = text.strip()
    if not line or "\n" in line:
        return None
    if line.startswith("file://"):
        line = unquote(urlparse(line).path)
    else:
        try:
            words = shlex.split(line)  # 'a b.png', "a b.png", a\ b.png
        except ValueError:
            return None
        if len(words) != 1:
            return None
        line = words[0]
    path = Path(line).expanduser()
    if path.suffix.lower() not in IMAGE_SUFFIXES:
        return None
    try:
        return path if path.is_file() else None
    except OSError:  # a name too long for the file system
        return None
