"""The layers import in one direction: cli → frontends → server → engine → models → config →
errors. A module imports only from its own layer or below, at top level, under TYPE_CHECKING or
inside a function alike; this test reads every import of every module and names each edge
against the order."""

from __future__ import annotations

import ast
from pathlib import Path

import llmcli

# Highest first. atomic.py and reading.py are helpers as low as errors.py: anything may write a
# file atomically, or read one within a bound.
LAYERS = ("cli", "frontends", "server", "engine", "models", "config", "errors")
MODULE_LAYER = {
    "errors": "errors",
    "atomic": "errors",
    "reading": "errors",
    "__init__": "cli",
    "__main__": "cli",
}
PACKAGE = Path(llmcli.__file__).parent


def layer_of(module: str) -> str:
    """'llmcli.engine.native.llama' → 'engine'; 'llmcli.errors' → 'errors'."""
    parts = module.split(".")
    head = parts[1] if len(parts) > 1 else "__init__"
    return MODULE_LAYER.get(head, head)


def imported_modules(path: Path) -> list[tuple[int, str]]:
    """Every llmcli module `path` imports, wherever the import statement stands."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.lineno, node.module))
    return [(line, name) for line, name in found if name == "llmcli" or name.startswith("llmcli.")]


def edges_against_the_order() -> list[str]:
    wrong = []
    for path in sorted(PACKAGE.rglob("*.py")):
        module = ".".join(("llmcli", *path.relative_to(PACKAGE).with_suffix("").parts))
        own = layer_of(module)
        for line, name in imported_modules(path):
            other = layer_of(name)
            if LAYERS.index(other) < LAYERS.index(own):
                wrong.append(f"{path.relative_to(PACKAGE.parent)}:{line} ({own}) imports {name} ({other})")
    return wrong


def test_every_module_belongs_to_a_layer() -> None:
    layers = {
        layer_of(".".join(("llmcli", *p.relative_to(PACKAGE).with_suffix("").parts)))
        for p in PACKAGE.rglob("*.py")
    }
    assert layers <= set(LAYERS), layers - set(LAYERS)


def test_imports_go_down_the_layers_only() -> None:
    wrong = edges_against_the_order()
    assert not wrong, (
        "imports against cli → frontends → server → engine → models → config → errors:\n" + "\n".join(wrong)
    )


def test_the_check_sees_an_upward_import(tmp_path: Path) -> None:
    """The check itself can fail: an import of the engine inside a function of the config layer
    is found, as one at top level would be."""
    source = tmp_path / "module.py"
    source.write_text("def f():\n    from llmcli.engine.loop import Engine\n    return Engine\n")
    ((line, name),) = imported_modules(source)
    assert (line, name) == (2, "llmcli.engine.loop")
    assert LAYERS.index(layer_of(name)) < LAYERS.index(layer_of("llmcli.config.settings"))
