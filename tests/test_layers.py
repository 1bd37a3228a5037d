"""The layers import in one direction: cli → frontends → server → engine → models → config →
errors. A module imports only from its own layer or below, at top level, under TYPE_CHECKING or
inside a function alike; this test reads every import of every module and names each edge
against the order."""

from __future__ import annotations

import ast
import re
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


def is_module(name: str) -> bool:
    """Whether `name` ('llmcli.models.gguf_tokenizer') is a module or package of llmcli."""
    place = PACKAGE.joinpath(*name.split(".")[1:])
    return place.with_suffix(".py").is_file() or (place / "__init__.py").is_file()


def imported_modules(path: Path) -> list[tuple[int, str]]:
    """Every llmcli module `path` imports, wherever the import statement stands. `from
    llmcli.models import gguf_tokenizer` imports the submodule, not the package; the package
    only where some imported name is not a submodule of it."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            submodules = [f"{node.module}.{alias.name}" for alias in node.names]
            modules = [name for name in submodules if is_module(name)]
            found += [(node.lineno, name) for name in modules]
            if len(modules) < len(submodules):
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


def module_name(path: Path) -> str:
    """'models/gguf.py' → 'llmcli.models.gguf'; a package's __init__.py → the package's name."""
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    return ".".join(("llmcli", *(parts[:-1] if parts[-1] == "__init__" else parts)))


def import_graph() -> dict[str, set[str]]:
    """Every llmcli module (a package's __init__ under the package's name) and the llmcli
    modules it imports, wherever the import stands. One graph, not one per folder: a circle
    through a subpackage (loop → speculative → loop) is a circle all the same."""
    paths = sorted(PACKAGE.rglob("*.py"))
    graph: dict[str, set[str]] = {module_name(path): set() for path in paths}
    for path in paths:
        module = module_name(path)
        graph[module] |= {name for _, name in imported_modules(path) if name in graph and name != module}
    return graph


def circles(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    lowest: dict[str, int] = {}
    stack: list[str] = []
    found: list[frozenset[str]] = []

    def visit(module: str) -> None:
        index[module] = lowest[module] = len(index)
        stack.append(module)
        for imported in sorted(graph[module]):
            if imported not in index:
                visit(imported)
                lowest[module] = min(lowest[module], lowest[imported])
            elif imported in stack:
                lowest[module] = min(lowest[module], index[imported])
        if lowest[module] == index[module]:
            component = []
            while not component or component[-1] != module:
                component.append(stack.pop())
            if len(component) > 1:
                found.append(frozenset(component))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return found


def test_no_import_circle() -> None:
    """No module imports, however indirectly, one that imports it back: each step of the load
    pipeline, each protocol's encoder, the engine's pieces stand below what uses them."""
    found = [", ".join(sorted(circle)) for circle in circles(import_graph())]
    assert not found, "modules that import each other in a circle:\n" + "\n".join(found)


def test_the_check_sees_a_circle_and_a_submodule(tmp_path: Path) -> None:
    """`from llmcli.models import gguf_tokenizer` is an import of that module; a circle through
    three modules is found as one."""
    source = tmp_path / "module.py"
    source.write_text(
        "from llmcli.models import gguf_tokenizer, load\nfrom llmcli.models import nothing_such\n"
    )
    assert imported_modules(source) == [
        (1, "llmcli.models.gguf_tokenizer"),
        (1, "llmcli.models.load"),
        (2, "llmcli.models"),
    ]
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert circles(graph) == [frozenset({"a", "b", "c"})]


def architecture_section() -> str:
    """README.md's "## Architecture" section, up to the next section."""
    readme = (PACKAGE.parents[1] / "README.md").read_text(encoding="utf-8")
    return readme.split("\n## Architecture\n", 1)[1].split("\n## ", 1)[0]


def test_the_architecture_map_names_every_module() -> None:
    """A newcomer finds every module in the README's map: by its file name (`prefix.py` or
    `prefix`), or by its folder (`native/`) for a package's __init__.py."""
    section = architecture_section()
    missing = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name == "__init__.py":
            named = f"{path.parent.name}/" in section
        else:
            named = re.search(rf"\b{re.escape(path.stem)}\b", section) is not None
        if not named:
            missing.append(str(path.relative_to(PACKAGE)))
    assert not missing, "modules README.md's architecture map does not name:\n" + "\n".join(missing)
