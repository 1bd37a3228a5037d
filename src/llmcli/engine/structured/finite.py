"""Whether some finite JSON value satisfies a schema, so that a constrained reply can end.

llguidance compiles `{"$ref": "#"}`, or an object whose required property is the object itself,
without complaint: the grammar is well formed, but every value it allows is infinitely deep, so
generation runs to the token limit and the reply is never valid. Such a schema is refused before
anything loads.

A schema can finish when a finite value satisfies it: types without children always can; an
object needs each required property to finish, an array its first `minItems` items; `anyOf` and
`oneOf` need one branch, `allOf` every one. References make this a least fixed point: every
referenced schema starts as "cannot finish" and is re-evaluated until nothing changes, so a cycle
counts only where a way out of it exists. Keywords that constrain values without nesting
(lengths, patterns, ranges) are llguidance's to check: this module looks at nesting only.
"""

from __future__ import annotations

from typing import Any

MAX_ROUNDS = 1000  # each round settles at least one reference; more are a schema too big to check


def can_finish(schema: Any) -> bool:
    references = _local_references(schema)
    finishes: dict[str, bool] = dict.fromkeys(references, False)
    for _ in range(MAX_ROUNDS):
        changed = False
        for reference in references:
            target = _resolve(schema, reference)
            value = target is not None and _finishes(target, finishes)
            if value != finishes[reference]:
                finishes[reference], changed = value, True
        if not changed:
            break
    return _finishes(schema, finishes)


def _finishes(schema: Any, finishes: dict[str, bool]) -> bool:
    if isinstance(schema, bool):
        return schema
    if not isinstance(schema, dict):
        return True
    if "$ref" in schema and not finishes.get(schema["$ref"], True):  # remote refs: llguidance's
        return False
    if "const" in schema or "enum" in schema:
        return True
    if "allOf" in schema and not all(_finishes(s, finishes) for s in _list(schema["allOf"])):
        return False
    for key in ("anyOf", "oneOf"):
        if key in schema and not any(_finishes(s, finishes) for s in _list(schema[key])):
            return False
    types = schema.get("type")
    types = types if isinstance(types, list) else [types] if isinstance(types, str) else None
    if types is None:  # no type: a string fits (object and array keywords bind only those)
        return True
    return any(_type_finishes(kind, schema, finishes) for kind in types)


def _type_finishes(kind: str, schema: dict[str, Any], finishes: dict[str, bool]) -> bool:
    if kind == "object":
        return _object_finishes(schema, finishes)
    if kind == "array":
        return _array_finishes(schema, finishes)
    return True


def _object_finishes(schema: dict[str, Any], finishes: dict[str, bool]) -> bool:
    properties = schema.get("properties") if isinstance(schema.get("properties"), dict) else {}
    required = schema.get("required") if isinstance(schema.get("required"), list) else []
    extra = schema.get("additionalProperties", True)
    for name in required:
        child = properties.get(name, extra) if isinstance(name, str) else True
        if not _finishes(child, finishes):
            return False
    return True


def _array_finishes(schema: dict[str, Any], finishes: dict[str, bool]) -> bool:
    needed = schema.get("minItems", 0) if isinstance(schema.get("minItems"), int) else 0
    prefix = _list(schema.get("prefixItems"))
    items = schema.get("items", True)
    for position in range(min(needed, len(prefix) + 1)):
        child = prefix[position] if position < len(prefix) else items
        if not _finishes(child, finishes):
            return False
    return True


def _list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else []


def _local_references(schema: Any) -> list[str]:
    found: set[str] = set()
    stack = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            reference = node.get("$ref")
            if isinstance(reference, str) and reference.startswith("#"):
                found.add(reference)
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    return sorted(found)


def _resolve(schema: Any, reference: str) -> Any:
    """The schema a local reference ("#", "#/$defs/node") points at; None where it points nowhere."""
    node = schema
    for raw in reference.removeprefix("#").split("/")[1:]:
        part = raw.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node
