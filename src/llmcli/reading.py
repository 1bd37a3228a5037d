"""Every file and stream llmcli reads for the user, read within a bound.

Without one, `llmcli generate < /dev/zero` or `--json-schema /dev/urandom` grows until the
machine runs out of memory. Each kind of input has a byte limit far above any real use; what is
over it is refused in one line that names the input and the limit, after reading at most one
byte more than the limit. Devices, sockets and folders are refused without reading: files and
pipes (stdin, `<(…)`) are what a user means to give. Text must be UTF-8, and JSON and TOML
nested too deeply for the parser are one line too, not a RecursionError.
"""

from __future__ import annotations

import json
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO

import tomllib

from llmcli.errors import UsageError

MiB = 1024 * 1024
PROMPT_BYTES = 64 * MiB  # a million-token context of prose is ~4 MiB of text
SCHEMA_BYTES = 16 * MiB  # --json-schema, --tools, --functions
TRANSCRIPT_BYTES = 256 * MiB  # /load: a whole chat, replies and thinking included
CONFIG_BYTES = 1 * MiB  # config.toml
BATCH_BYTES = 256 * MiB  # --batch: many prompts


def read_file(path: str | Path, limit: int, where: str) -> bytes:
    """The bytes of a file (or a pipe), at most `limit` of them; `where` names it for the user."""
    path = Path(path).expanduser()
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        raise UsageError(f"{where}: no such file") from None
    except OSError as error:
        raise UsageError(f"{where}: cannot read it ({error.strerror})") from None
    if stat.S_ISDIR(mode):
        raise UsageError(f"{where}: a folder, not a file")
    if not (stat.S_ISREG(mode) or stat.S_ISFIFO(mode)):
        raise UsageError(f"{where}: not a regular file (a device or socket): give a file")
    try:
        with path.open("rb") as handle:
            return read_stream(handle, limit, where)
    except OSError as error:
        raise UsageError(f"{where}: cannot read it ({error.strerror})") from None


def read_stream(stream: BinaryIO, limit: int, where: str) -> bytes:
    data = stream.read(limit + 1)
    if len(data) > limit:
        raise UsageError(f"{where}: over the {limit // MiB} MiB limit for this input", _TOO_BIG_HINT)
    return data


_TOO_BIG_HINT = "no model's context holds that much; give the part that matters"


def bounded_lines(stream: BinaryIO, limit: int) -> Iterator[bytes | None]:
    """The lines of a stream, each of at most `limit` bytes; None for a longer line, whose rest
    is read past in pieces (never held whole)."""
    while True:
        line = stream.readline(limit + 1)
        if not line:
            return
        if len(line) <= limit or line.endswith(b"\n"):
            yield line
            continue
        while line and not line.endswith(b"\n"):
            line = stream.readline(MiB)
        yield None


def decode(data: bytes, where: str) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise UsageError(
            f"{where}: not valid UTF-8 (byte 0x{data[error.start]:02x} at offset {error.start})",
            "convert it first, e.g. with `iconv -t UTF-8`",
        ) from None


def read_text(path: str | Path, limit: int, where: str) -> str:
    return decode(read_file(path, limit, where), where)


def parse_json(text: str, where: str) -> Any:
    try:
        return json.loads(text)
    except RecursionError:
        raise UsageError(f"{where}: nested too deeply to read") from None
    except ValueError as error:
        raise UsageError(f"{where}: not valid JSON ({error})") from None


def parse_toml(text: str, where: str) -> dict[str, Any]:
    try:
        return tomllib.loads(text)
    except RecursionError:
        raise UsageError(f"{where}: nested too deeply to read") from None
    except tomllib.TOMLDecodeError as error:
        raise UsageError(f"{where}: {error}", "fix the file, or point LLMCLI_CONFIG elsewhere") from None


# Text from a peer (a server's error message, a model's name) shown in one line on stderr: at
# most this many characters, then "…". A hostile server's 5 MB message is not a "line".
SHOWN_CHARS = 300
# Unicode's bidirectional overrides and isolates: they reorder what follows them on screen, so
# that a line can read differently from what it says.
_BIDI = frozenset("\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069")
_NAMED = {"\n": "\\n", "\t": "\\t", "\r": "\\r"}


def escape_controls(text: str, keep: str = "") -> str:
    """`text` with every control character (C0, DEL, C1, a bidi override) but those in `keep`
    written out as an escape (ESC → \\x1b): shown on a terminal, none of them acts. An escape
    sequence would otherwise set the window's title, clear the line or fake an `llmcli:` line."""
    if text.isprintable():  # no control or format character at all: the common case, at C speed
        return text
    return "".join(_escaped(ch) if ch not in keep and _acts(ch) else ch for ch in text)


def _acts(ch: str) -> bool:
    code = ord(ch)
    return code < 0x20 or 0x7F <= code < 0xA0 or ch in _BIDI


def _escaped(ch: str) -> str:
    code = ord(ch)
    return _NAMED.get(ch) or (f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}")


def peer_text(text: str, limit: int = SHOWN_CHARS) -> str:
    """What a peer sent, as one line of at most `limit` characters, nothing in it acting."""
    shown = escape_controls(text)
    return shown if len(shown) <= limit else shown[:limit] + "…"
