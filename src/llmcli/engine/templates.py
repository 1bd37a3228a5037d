"""Chat templates rendered in a bounded sandbox.

A chat template is code from whoever published the model. Jinja's immutable sandbox keeps it
away from Python's internals, but not from the machine's memory and time: `{{ 'A' * 4000000000 }}`
asks for gigabytes and two nested loops over `range(100000)` never end. Here every operation that
can make something big is checked before it runs, the text made along the way is counted, and a
render that runs too long is stopped; a template that goes over any bound is refused in one line
(`TemplateLimitError`, a jinja `TemplateError`, so callers treat it as any refused template).

The environment is the one transformers gives templates (trim_blocks, lstrip_blocks, loop
controls, `{% generation %}`, `tojson` that does not escape HTML, `raise_exception`,
`strftime_now`, `dict`, `namespace`), so a template renders here exactly as it does there.
"""

from __future__ import annotations

import ctypes
import functools
import json
import operator
import re
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime
from typing import Any, ClassVar

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.compiler import CodeGenerator, Frame
from jinja2.exceptions import TemplateError
from jinja2.sandbox import MAX_RANGE, ImmutableSandboxedEnvironment
from jinja2.utils import Namespace

MAX_SECONDS = 5.0  # a long chat renders in milliseconds
MAX_TEXT = 32 * 1024 * 1024  # characters in the output, and in any one value made on the way
MAX_ITEMS = 1024 * 1024  # items in any one list or tuple made on the way
MAX_MADE = 256 * 1024 * 1024  # characters and items made in all, over one render
MAX_WIDTH = 100_000  # a width, padding or indent a template may ask for
_BIG_NUMBER = re.compile(r"\d{6,}")  # a width of ≥ 100000 in a format string


class TemplateLimitError(TemplateError):
    """The template went over a bound: too long, too big, or too much made."""


class _Budget(threading.local):
    made = 0  # characters and items made so far in this thread's render


_budget = _Budget()


def _size(value: Any) -> int:
    return len(value) if isinstance(value, (str, list, tuple, dict)) else 0


def _made(value: Any) -> Any:
    """Count what an operation made; refuse a value, or a render, that is too big."""
    size = _size(value)
    if size > (MAX_ITEMS if isinstance(value, (list, tuple, dict)) else MAX_TEXT):
        raise TemplateLimitError(f"it made a value of size {size}, over the bound")
    _budget.made += size
    if _budget.made > MAX_MADE:
        raise TemplateLimitError(f"it made over {MAX_MADE} characters and items in one render")
    return value


def _check_result_size(estimate: int, sequence: Any) -> None:
    items = isinstance(sequence, (list, tuple))
    if estimate > (MAX_ITEMS if items else MAX_TEXT):
        unit = "items" if items else "characters"
        raise TemplateLimitError(f"it asked for a value of {estimate} {unit}, over the bound")


def _times(left: Any, right: Any) -> Any:
    for sequence, count in ((left, right), (right, left)):
        if isinstance(sequence, (str, list, tuple)) and isinstance(count, int):
            _check_result_size(len(sequence) * max(count, 0), sequence)
    return _made(operator.mul(left, right))


def _power(left: Any, right: Any) -> Any:
    exact = isinstance(left, int) and isinstance(right, int) and abs(left) > 1 and right > 0
    if exact and right * abs(left).bit_length() > 64 * 1024:  # an integer of over 64 Kbit
        raise TemplateLimitError("it asked for an integer too big to compute")
    return operator.pow(left, right)


def _plus(left: Any, right: Any) -> Any:
    if isinstance(left, (str, list, tuple)) and isinstance(right, type(left)):
        _check_result_size(len(left) + len(right), left)
    return _made(operator.add(left, right))


def _check_format(text: str) -> None:
    if _BIG_NUMBER.search(text):
        raise TemplateLimitError(f"it formats with a width of {MAX_WIDTH} or more")


def _modulo(left: Any, right: Any) -> Any:
    if isinstance(left, str):
        _check_format(left)
    return _made(operator.mod(left, right))


_WIDENING = {"center", "ljust", "rjust", "zfill", "expandtabs"}


def _check_call(target: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Arguments that would make a string method's result huge."""
    owner, name = getattr(target, "__self__", None), getattr(target, "__name__", "")
    if not isinstance(owner, str):
        return
    if name in _WIDENING and any(isinstance(a, int) and a > MAX_WIDTH for a in (*args, *kwargs.values())):
        raise TemplateLimitError(f"it asked str.{name} for a width over {MAX_WIDTH}")
    if name == "replace" and len(args) >= 2 and isinstance(args[0], str) and isinstance(args[1], str):
        grows = len(args[1]) - len(args[0])
        count = owner.count(args[0]) if args[0] else len(owner) + 1
        _check_result_size(len(owner) + max(grows, 0) * count, owner)


def _bounded_center(value: str, width: int = 80) -> str:
    if width > MAX_WIDTH:
        raise TemplateLimitError(f"it asked for a width over {MAX_WIDTH}")
    return _made(str(value).center(width))


def _bounded_indent(value: str, width: int | str = 4, first: bool = False, blank: bool = False) -> str:
    pad = len(width) if isinstance(width, str) else width
    _check_result_size((str(value).count("\n") + 1) * pad + len(str(value)), "")
    return _made(jinja2.filters.do_indent(value, width, first, blank))


def _bounded_format(value: str, *args: Any, **kwargs: Any) -> str:
    _check_format(str(value))
    return _made(jinja2.filters.do_format(value, *args, **kwargs))


def _tojson(
    value: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None, sort_keys=False
) -> str:
    # As transformers: no HTML escaping (templates write JSON into prompts, not web pages).
    if isinstance(indent, int) and indent > 64:
        raise TemplateLimitError("it asked tojson for an indent over 64")
    text = json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )
    return _made(text)


def _bounded_range(*args: int) -> range:
    """jinja's sandbox range, whose bound it enforces with an OverflowError (which no caller takes
    for a template's limit): over the bound, a limit as the others are."""
    numbers = range(*args)
    if len(numbers) > MAX_RANGE:
        raise TemplateLimitError(
            f"it asked for a range of {len(numbers)} numbers, over the bound of {MAX_RANGE}"
        )
    return numbers


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


def _strftime_now(format: str) -> str:
    _check_format(format)
    return datetime.now().strftime(format)


class _TemplateDict:
    """`dict(...)` for templates, without the type itself (and its attributes) in reach."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return _made(dict(*args, **kwargs))

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return _made(dict.fromkeys(*args, **kwargs))


class _Namespace(Namespace):
    """`namespace(...)` that stores no underscore names (nothing that looks like Python's own)."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # jinja's own signature trick: `self` may be a key
        self, rest = args[0], args[1:]
        values = dict(*rest, **kwargs)
        for name in values:
            _Namespace._check(name)
        Namespace.__init__(self, values)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check(name)
        Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"a chat template cannot store {name!r} in a namespace")


class _Generation(jinja2.ext.Extension):
    """`{% generation %}…{% endgeneration %}` marks the assistant's part for training masks;
    rendering a prompt needs only its body."""

    tags: ClassVar[set[str]] = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        line = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(line)

    def _body(self, caller: Any) -> str:
        return caller()


class _CountingCodeGenerator(CodeGenerator):
    """`a ~ b ~ c` joins strings without an operator the sandbox can intercept: count it."""

    def visit_Concat(self, node: jinja2.nodes.Concat, frame: Frame) -> None:
        self.write("environment.concat((")
        for part in node.nodes:
            self.visit(part, frame)
            self.write(", ")
        self.write("))")


class BoundedSandbox(ImmutableSandboxedEnvironment):
    code_generator_class = _CountingCodeGenerator
    intercepted_binops = frozenset({"*", "**", "+", "%"})

    def __init__(self) -> None:
        super().__init__(
            trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, jinja2.ext.loopcontrols]
        )
        self.binop_table.update({"*": _times, "**": _power, "+": _plus, "%": _modulo})
        self.filters.update(
            center=_bounded_center, indent=_bounded_indent, format=_bounded_format, tojson=_tojson
        )
        self.globals.update(
            range=_bounded_range,
            raise_exception=_raise_exception,
            strftime_now=_strftime_now,
            dict=_TemplateDict(),
            namespace=_Namespace,
        )

    def concat(self, parts: tuple[Any, ...]) -> str:
        texts = [str(part) for part in parts]
        _check_result_size(sum(map(len, texts)), "")
        return _made("".join(texts))

    def getattr(self, obj: Any, attribute: str) -> Any:
        if isinstance(obj, str) and attribute in ("format", "format_map"):
            _check_format(obj)
        return super().getattr(obj, attribute)

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:
        _check_call(__obj, args, kwargs)
        return _made(super().call(__context, __obj, *args, **kwargs))


@functools.lru_cache(maxsize=16)
def compiled(source: str) -> jinja2.Template:
    return BoundedSandbox().from_string(source)


def render_template(source: str, **context: Any) -> str:
    """`source` rendered with `context`, within the bounds (time, output, what is made)."""
    template = compiled(source)
    _budget.made = 0
    pieces: list[str] = []
    length = 0
    with _time_limit(MAX_SECONDS):
        try:
            for piece in template.generate(**context):
                length += len(piece)
                if length > MAX_TEXT:
                    raise TemplateLimitError(f"its output went over {MAX_TEXT} characters")
                pieces.append(piece)
        except RecursionError:  # a macro that calls itself: Python's own bound on depth
            raise TemplateLimitError("it nested calls deeper than Python allows") from None
    return "".join(pieces)


class _TimeUp(BaseException):
    """Raised inside the rendering thread when its time is up. A BaseException, so no handler
    for ordinary errors between here and the render catches it."""


@contextmanager
def _time_limit(seconds: float) -> Iterator[None]:
    """Stop the code inside after `seconds`, by raising `_TimeUp` in this thread from a timer.

    Rendering is Python code (jinja compiles templates to it), and Python delivers such an
    exception between two bytecodes, so even an empty loop stops. The lock orders the timer
    against the end of the block: an exception set but not yet raised is taken back."""
    thread = ctypes.c_ulong(threading.get_ident())
    lock = threading.Lock()
    state = {"done": False, "fired": False}

    def fire() -> None:
        with lock:
            if not state["done"]:
                state["fired"] = True
                ctypes.pythonapi.PyThreadState_SetAsyncExc(thread, ctypes.py_object(_TimeUp))

    timer = threading.Timer(seconds, fire)
    timer.daemon = True
    timer.start()
    try:
        try:
            yield
        finally:
            timer.cancel()
            with lock:
                state["done"] = True
                if state["fired"]:
                    ctypes.pythonapi.PyThreadState_SetAsyncExc(thread, None)
    except _TimeUp:
        raise TemplateLimitError(f"it ran for over {seconds:g} s") from None
