"""Backslash escapes in stop strings typed on a command line, as llama.cpp reads its reverse
prompts: a shell passes `--stop "\\n\\n"` as backslash-n twice, and nobody means that.

Known escapes: \\n \\t \\r \\0 \\\\ \\" \\' \\xHH \\uXXXX \\UXXXXXXXX. Any other backslash stays as it is.
The config file is TOML, which has its own escapes: its values are not unescaped again.
"""

from __future__ import annotations

import re

_SIMPLE = {"n": "\n", "t": "\t", "r": "\r", "0": "\0", "\\": "\\", '"': '"', "'": "'"}
_ESCAPE = re.compile(r"\\(?:([ntr0\\\"'])|x([0-9a-fA-F]{2})|u([0-9a-fA-F]{4})|U([0-9a-fA-F]{8}))")


def unescape(text: str) -> str:
    def replace(match: re.Match[str]) -> str:
        simple, byte, short, long = match.groups()
        if simple is not None:
            return _SIMPLE[simple]
        code = int(byte or short or long, 16)
        return chr(code) if code <= 0x10FFFF else match.group(0)

    return _ESCAPE.sub(replace, text)
