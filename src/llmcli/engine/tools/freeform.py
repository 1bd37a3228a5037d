"""A custom tool's freeform input, held to its grammar inside the JSON string the call carries it in.

A custom tool (OpenAI's `{"type": "custom", "format": {"type": "grammar", "syntax": "lark"}}`)
is offered to the template as a function of one string argument, `input`, so every family writes
its call as it writes any other, `{"name": "apply_patch", "arguments": {"input": "…"}}`, and
the template shows earlier calls the same way. The input is then JSON-escaped text, and the
grammar must hold the escaped text to the tool's grammar.

JSON escaping maps each character on its own (`"` → `\\"`, a newline → `\\n`, other control
characters → `\\u00XX`, the rest as they are, as json.dumps writes them), so the escaped texts of
a context-free language are again one: the same rules, each string literal escaped, each regex
replaced by the escaped image of its texts. One thing must change shape: llguidance's lexer is
greedy and never backs up, so a lexeme that may go on with an escape (`\\t` inside a file name)
would swallow the `\\` of the `\\n` that should end it. Every escape sequence is therefore a
lexeme of its own: a regex holding special characters becomes a rule (runs of plain characters,
escape lexemes), and an uppercase terminal whose image needs that becomes a rule too (renamed
`term_…`, since llguidance's terminals are single regexes). The grammar then sits in a
`%lark { … }` block of its own (its own `start` and names) inside the call's grammar.

What cannot be escaped this way is refused in one line: `%ignore` (it would skip raw text
between escaped lexemes) and llguidance's other directives, `%json`, nested `%lark`, special
tokens, grammar references, case-insensitive literals, back-references and lookarounds, and
regex syntax Python's `re` parser reads differently from Rust's (`\\p{…}`, `[[:alpha:]]`).
"""

from __future__ import annotations

import functools
import json
import re
import warnings
from dataclasses import dataclass
from typing import Any

from llmcli.errors import UsageError

SPECIAL = frozenset('"\\' + "".join(map(chr, range(0x20))))  # what JSON writes escaped
SHORT_ESCAPES = {'"': '"', "\\": "\\", "\b": "b", "\t": "t", "\n": "n", "\f": "f", "\r": "r"}
PLAIN = r'[^"\\\x{0}-\x{1f}]'  # every other character, written as it is
REFUSED = "cannot be used in a custom tool's grammar (its input is written as a JSON string)"

# Lark's common.lark terminals (as llguidance ships them), for `%import common.NAME`.
COMMON = {
    "DIGIT": r"[0-9]",
    "HEXDIGIT": r"[a-fA-F0-9]",
    "INT": r"[0-9]+",
    "SIGNED_INT": r"(\+|-)?[0-9]+",
    "DECIMAL": r"([0-9]+\.[0-9]*)|(\.[0-9]+)",
    "FLOAT": r"([0-9]+\.[0-9]*|\.[0-9]+)([eE](\+|-)?[0-9]+)?|[0-9]+[eE](\+|-)?[0-9]+",
    "NUMBER": r"([0-9]+)|([0-9]+\.[0-9]*|\.[0-9]+)([eE](\+|-)?[0-9]+)?|[0-9]+[eE](\+|-)?[0-9]+",
    "ESCAPED_STRING": r'"([^"\\]|\\.)*"',
    "LCASE_LETTER": r"[a-z]",
    "UCASE_LETTER": r"[A-Z]",
    "LETTER": r"[A-Za-z]",
    "WORD": r"[A-Za-z]+",
    "CNAME": r"[_A-Za-z][_A-Za-z0-9]*",
    "WS_INLINE": r"[ \t]+",
    "WS": r"[ \t\f\r\n]+",
    "CR": r"\r",
    "LF": r"\n",
    "NEWLINE": r"(\r?\n)+",
    "SH_COMMENT": r"#[^\n]*",
    "CPP_COMMENT": r"//[^\n]*",
    "SQL_COMMENT": r"--[^\n]*",
}


@dataclass(frozen=True)
class Freeform:
    """A custom tool's input format: `syntax` "lark" or "regex" with its `definition`, or
    "text" (any text)."""

    syntax: str
    definition: str = ""

    def note(self) -> str:
        """What the template's description of the tool adds, so that the model knows the form."""
        if self.syntax == "lark":
            return f"\n\nThe input is raw text in this Lark grammar:\n{self.definition}"
        if self.syntax == "regex":
            return f"\n\nThe input is raw text matching this regular expression: {self.definition}"
        return ""

    def escaped_lark(self) -> str:
        """The grammar of the input as the JSON string's content (between its quotes)."""
        if self.syntax == "regex":
            return f"start: {escaped_regex(self.definition, '')}\n"
        return escaped_lark(self.definition)

    def input_lark(self) -> str:
        """The input, escaped, as a Lark expression: a nested grammar of its own (made once per
        grammar: a client such as Codex sends the same one with every request)."""
        return _input_lark(self)


@functools.lru_cache(maxsize=32)
def _input_lark(freeform: Freeform) -> str:
    return f"%lark {{\n{freeform.escaped_lark()}\n}}"


def json_escaped(text: str) -> str:
    """`text` as json.dumps writes it inside a string (non-ASCII as it is)."""
    return json.dumps(text, ensure_ascii=False)[1:-1]


# ---- Lark ----------------------------------------------------------------------------------

_LARK_TOKEN = re.compile(
    r"""(?P<comment>(\#|//)[^\n]*)
    |(?P<string>"(\\.|[^"\\\n])*"i?)
    |(?P<range>\.\.)
    |(?P<regex>/(\\.|[^/\\\n])+/[imslux]*)
    |(?P<refused>%[a-z]+|<[^<>\s]+>|@[A-Za-z0-9_-]+)
    |(?P<name>[A-Za-z_][A-Za-z0-9_]*)
    |(?P<other>[^"/#<@%.A-Za-z_]+|.)""",
    re.VERBOSE | re.DOTALL,
)
_TERMINAL = re.compile(r"_?[A-Z][A-Z0-9_]*")
_IMPORT = re.compile(r"^[ \t]*%import\s+common(?:\.(\w+)(?:\s*->\s*(\w+))?|\s*\(([^)]*)\))[ \t]*$", re.M)


def escaped_lark(grammar: str) -> str:
    """A Lark grammar whose texts are the JSON-escaped texts of `grammar`'s."""
    grammar = _IMPORT.sub(_common_definitions, grammar)
    tokens = [(match.lastgroup, match.group(0)) for match in _LARK_TOKEN.finditer(grammar)]
    out: list[str] = []
    index = 0
    while index < len(tokens):
        kind, text = tokens[index]
        if kind == "refused":
            raise UsageError(f"{text} {REFUSED}")
        if kind == "string" and [k for k, _ in tokens[index + 1 : index + 3]] == ["range", "string"]:
            low, high = ord(_string(text)), ord(_string(tokens[index + 2][1]))
            out.append(_class_expression([(low, high)], negate=False, repeated=False))
            index += 3
            continue
        if kind == "string":
            out.append(_lark_string(json_escaped(_string(text))))
        elif kind == "regex":
            body, flags = text[1:].rsplit("/", 1)
            out.append(escaped_regex(body.replace("\\/", "/"), flags))
        elif kind == "name" and _TERMINAL.fullmatch(text):  # a terminal: a rule now (see above)
            underscore = "_" if text.startswith("_") else ""
            out.append(f"{underscore}term_{text.lstrip('_').lower()}")
        elif kind != "comment":
            out.append(text)
        index += 1
    return "".join(out)


def _common_definitions(match: re.Match[str]) -> str:
    single, alias, several = match.groups()
    names = [(single, alias or single)] if single else [(n.strip(), n.strip()) for n in several.split(",")]
    lines = []
    for name, as_name in names:
        if name not in COMMON:
            raise UsageError(f"%import common.{name}: not a terminal of Lark's common grammar")
        lines.append(f"{as_name}: /{COMMON[name].replace('/', chr(92) + '/')}/")
    return "\n".join(lines)


def _string(literal: str) -> str:
    """A Lark string literal's text (JSON's escapes, and \\xNN)."""
    if literal.endswith("i"):
        raise UsageError(f"the case-insensitive literal {literal} {REFUSED}")
    body = re.sub(r"\\x([0-9a-fA-F]{2})", lambda hex_: f"\\u00{hex_.group(1)}", literal)
    try:
        return json.loads(body)
    except ValueError:
        raise UsageError(f"{literal}: not a string literal llguidance reads") from None


def _lark_string(text: str) -> str:
    """`text` as a Lark string literal (JSON's syntax; DEL must be escaped there)."""
    return json.dumps(text, ensure_ascii=False).replace("\x7f", "\\u007f")


# ---- regular expressions ---------------------------------------------------------------------

_FLAGS = {"s": re.DOTALL, "x": re.VERBOSE, "m": 0, "u": 0}


def escaped_regex(pattern: str, flags: str) -> str:
    """A Lark expression matching the JSON-escaped texts of the regex `pattern`'s (Python's `re`
    reads it; llguidance's Rust syntax is written back)."""
    from re import _parser  # type: ignore[attr-defined]

    bits = 0
    for flag in flags:
        if flag not in _FLAGS:
            raise UsageError(f"the regex flag {flag} {REFUSED}")
        bits |= _FLAGS[flag]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # Python reading `[[:alpha:]]` or `&&` otherwise than Rust
        try:
            parsed = _parser.parse(pattern, bits)
        except (re.error, FutureWarning) as error:
            raise UsageError(f"/{pattern}/: {error}") from None
    if parsed.state.flags & re.IGNORECASE:
        raise UsageError(f"/{pattern}/: (?i) {REFUSED}")
    items = list(parsed.data)
    items = items[1:] if items and _anchor(items[0], begin=True) else items
    items = items[:-1] if items and _anchor(items[-1], begin=False) else items
    try:
        return _Escaper(bool(parsed.state.flags & re.DOTALL)).expression(items)
    except _Unsupported as error:
        raise UsageError(f"/{pattern}/: {error} {REFUSED}") from None


class _Unsupported(Exception):
    pass


def _anchor(item: tuple[Any, Any], begin: bool) -> bool:
    from re import _constants as c  # type: ignore[attr-defined]

    op, value = item
    starts, ends = (c.AT_BEGINNING, c.AT_BEGINNING_STRING), (c.AT_END, c.AT_END_STRING)
    return op is c.AT and value in (starts if begin else ends)


class _Escaper:
    """re's parse tree → a Lark expression: what holds no special character stays one regex
    lexeme (as the pattern was); what does becomes rule structure with escapes as lexemes."""

    def __init__(self, dotall: bool) -> None:
        from re import _constants as c  # type: ignore[attr-defined]

        self.c, self.dotall = c, dotall

    def expression(self, items: list[tuple[Any, Any]]) -> str:
        parts: list[str] = []
        plain: list[tuple[Any, Any]] = []  # special-free items, written as one regex lexeme
        for item in items:
            if self._special_free(item):
                plain.append(item)
                continue
            if plain:
                parts.append(f"/{self._regex(plain)}/")
                plain = []
            parts.append(self._item(*item))
        if plain:
            parts.append(f"/{self._regex(plain)}/")
        return "(" + " ".join(parts) + ")" if parts else '""'

    def _item(self, op: Any, value: Any) -> str:
        c = self.c
        if op is c.LITERAL:
            return _lark_string(json_escaped(chr(value)))
        if op is c.BRANCH:
            branches = [list(branch) for branch in value[1]]
            alternatives = " | ".join(self.expression(branch) for branch in branches if branch)
            return f"({alternatives})" + ("?" if any(not branch for branch in branches) else "")
        if op is c.SUBPATTERN:
            return self.expression(list(self._inner(value)))
        if op in (c.MAX_REPEAT, c.MIN_REPEAT):  # laziness does not change the language
            low, high, inner = value
            inner = list(inner)
            single = inner[0] if len(inner) == 1 and self._class_of(inner[0]) is not None else None
            if single is not None and low <= 1 and high is c.MAXREPEAT:  # runs of plain characters
                items, negate = self._class_of(single)
                return _class_expression(items, negate, repeated=True) + ("+" if low else "*")
            body = self.expression(inner)
            if high is c.MAXREPEAT:
                return f"{body} ~ {low} {body}*" if low > 1 else body + ("+" if low else "*")
            return f"{body} ~ {low}..{high}"
        found = self._class_of((op, value))
        if found is not None:
            return _class_expression(*found, repeated=False)
        raise _Unsupported(_describe(op, c))

    def _inner(self, value: Any) -> Any:
        _group, add_flags, _del_flags, inner = value
        if add_flags & re.IGNORECASE:
            raise _Unsupported("(?i)")
        if add_flags & re.DOTALL:  # (?s:…): only a whole pattern's flags are followed
            raise _Unsupported("(?s:…)")
        return inner

    def _class_of(self, item: tuple[Any, Any]) -> tuple[list[Any], bool] | None:
        """A one-character item as (class items, negated); None for anything else."""
        c = self.c
        op, value = item
        if op is c.NOT_LITERAL:
            return [(value, value)], True
        if op is c.ANY:
            return ([] if self.dotall else [(10, 10)]), True
        if op is c.IN:
            negate = bool(value) and value[0][0] is c.NEGATE
            return list(value[1:] if negate else value), negate
        return None

    def _special_free(self, item: tuple[Any, Any]) -> bool:
        c = self.c
        op, value = item
        if op is c.LITERAL:
            return chr(value) not in SPECIAL
        if op is c.BRANCH:
            return all(self._special_free(child) for branch in value[1] for child in branch)
        if op is c.SUBPATTERN:
            return all(self._special_free(child) for child in self._inner(value))
        if op in (c.MAX_REPEAT, c.MIN_REPEAT):
            return all(self._special_free(child) for child in value[2])
        found = self._class_of(item)
        return found is not None and not _class_specials(*found)

    def _regex(self, items: list[tuple[Any, Any]]) -> str:
        """Special-free items in Rust's regex syntax."""
        return "".join(self._regex_item(op, value) for op, value in items)

    def _regex_item(self, op: Any, value: Any) -> str:
        c = self.c
        if op is c.LITERAL:
            return _char(chr(value))
        if op is c.BRANCH:
            return "(?:" + "|".join(self._regex(list(branch)) for branch in value[1]) + ")"
        if op is c.SUBPATTERN:
            return "(?:" + self._regex(list(self._inner(value))) + ")"
        if op in (c.MAX_REPEAT, c.MIN_REPEAT):
            low, high, inner = value
            bound = f"{{{low},}}" if high is c.MAXREPEAT else f"{{{low},{high}}}"
            return "(?:" + self._regex(list(inner)) + ")" + bound
        found = self._class_of((op, value))
        if found is None:
            raise _Unsupported(_describe(op, c))
        return _rust_class(*found)


def _describe(op: Any, c: Any) -> str:
    names = {c.AT: "an anchor inside the pattern", c.GROUPREF: "a back-reference"}
    return names.get(op, str(op).lower().replace("_", " "))


def _char(char: str) -> str:
    return char if char.isalnum() and char.isascii() else f"\\x{{{ord(char):x}}}"


# Which special characters Rust's (Unicode) classes hold: \s is White_Space; \d and \w hold none.
_SPACES = frozenset("\t\n\x0b\x0c\r")


def _class_parts(items: list[Any]) -> tuple[list[str], set[str]]:
    """A class's items in Rust's syntax, and the special characters they hold."""
    from re import _constants as c  # type: ignore[attr-defined]

    categories = {
        c.CATEGORY_DIGIT: (r"\d", frozenset()),
        c.CATEGORY_NOT_DIGIT: (r"\D", SPECIAL),
        c.CATEGORY_SPACE: (r"\s", _SPACES),
        c.CATEGORY_NOT_SPACE: (r"\S", SPECIAL - _SPACES),
        c.CATEGORY_WORD: (r"\w", frozenset()),
        c.CATEGORY_NOT_WORD: (r"\W", SPECIAL),
    }
    parts: list[str] = []
    holds: set[str] = set()
    for item in items:
        if type(item[0]) is int:  # a (low, high) range of code points
            low, high = item
        elif item[0] is c.LITERAL:
            low = high = item[1]
        elif item[0] is c.RANGE:
            low, high = item[1]
        elif item[0] is c.CATEGORY and item[1] in categories:
            text, special = categories[item[1]]
            parts.append(text)
            holds |= special
            continue
        else:
            raise _Unsupported(f"the class item {item}")
        parts.append(_char(chr(low)) if low == high else f"{_char(chr(low))}-{_char(chr(high))}")
        holds |= {char for char in SPECIAL if low <= ord(char) <= high}
    return parts, holds


def _class_specials(items: list[Any], negate: bool) -> set[str]:
    holds = _class_parts(items)[1]
    return set(SPECIAL) - holds if negate else holds


def _rust_class(items: list[Any], negate: bool) -> str:
    parts = _class_parts(items)[0]
    if not parts:  # nothing listed: every character, or none
        return r"[\x{0}-\x{10ffff}]" if negate else r"[^\x{0}-\x{10ffff}]"
    return "[" + ("^" if negate else "") + "".join(parts) + "]"


def _class_expression(items: list[Any], negate: bool, repeated: bool) -> str:
    """One character of a class (or, `repeated`, a run of its plain ones), escaped: its plain
    characters as they are, or one escape lexeme for the special ones it holds."""
    holds = _class_specials(items, negate)
    plain = f"/[{_rust_class(items, negate)}&&{PLAIN}]{'+' if repeated else ''}/"
    escapes = f"/{_escapes(holds)}/"
    if not holds:
        return plain
    if not negate and _only_special(items):
        return f"({escapes})"  # (a repeat's operator follows)
    return f"({plain} | {escapes})"


def _only_special(items: list[Any]) -> bool:
    """A class of literals and ranges that holds no plain character."""
    from re import _constants as c  # type: ignore[attr-defined]

    for item in items:
        if type(item[0]) is int or item[0] is c.RANGE:
            low, high = item if type(item[0]) is int else item[1]
        elif item[0] is c.LITERAL:
            low = high = item[1]
        else:
            return False
        if any(chr(code) not in SPECIAL for code in range(low, min(high, 0x5C) + 1)) or high > 0x5C:
            return False
    return True


def _escapes(chars: set[str]) -> str:
    """A regex for the escape sequences of `chars` (special characters), as json.dumps writes them."""
    short = sorted(SHORT_ESCAPES[char] for char in chars if char in SHORT_ESCAPES)
    by_high: dict[int, list[str]] = {}
    for char in sorted(chars - set(SHORT_ESCAPES)):
        by_high.setdefault(ord(char) >> 4, []).append(f"{ord(char) & 15:x}")
    options = ["[" + "".join(_char(char) for char in short) + "]"] if short else []
    options += [f"u00{high}[{''.join(lows)}]" for high, lows in sorted(by_high.items())]
    return r"\x{5c}(?:" + "|".join(options) + ")"


# ---- the input, read back ------------------------------------------------------------------

_INPUT_HEAD = re.compile(r'\s*\{\s*"input"\s*:\s*"')


def call_input(arguments: str) -> str:
    """A custom call's raw input, out of its arguments (`{"input": "…"}`)."""
    value = json.loads(arguments)
    return value["input"] if isinstance(value, dict) and isinstance(value.get("input"), str) else arguments


def input_so_far(arguments: str) -> str:
    """The raw input that a custom call's arguments hold so far, as they stream: decoded up to
    its last whole character (an escape cut in two waits for its end)."""
    head = _INPUT_HEAD.match(arguments)
    if head is None:
        return ""
    body, escaped = arguments[head.end() :], False
    for position, char in enumerate(body):
        if escaped:
            escaped = False
        elif char == "\\":
            escaped = True
        elif char == '"':  # the string's end
            body = body[:position]
            break
    for cut in range(len(body), max(len(body) - 12, -1), -1):  # \ud83d\ude00 at the longest
        try:
            return json.loads(f'"{body[:cut]}"')
        except ValueError:
            continue
    return ""
