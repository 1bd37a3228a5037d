"""The model families the native engine runs, picked by architecture.

Which architectures run natively, and which module of this package runs each, is declared once,
torch-free, in models/families.py (a row per architecture, its `runtime` naming the module), so
the loader can ask before importing torch; here each runtime name finds its module. Adding a
family is its row there and, for a new kind of block, a module here that gives
`check_supported` and `weights`.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any

from llmcli.engine.native.families.base import NotSupported
from llmcli.models.families import RUNTIMES, family

FAMILIES: dict[str, ModuleType] = {name: importlib.import_module(f"{__name__}.{name}") for name in RUNTIMES}


def family_of(model: Any) -> ModuleType:
    # A lean-loaded model (models/lean_model.py) names the architecture its tensors are of.
    name = getattr(model, "architecture", None) or type(model).__name__
    row = family(name)
    if row is None:
        families = ", ".join(RUNTIMES.values())
        raise NotSupported(f"{name} is not in a family the native engine runs ({families})")
    return FAMILIES[row.runtime]


def check_supported(model: Any, context_length: int) -> None:
    """Raise NotSupported unless `model` runs on the native engine; the message says why."""
    family_of(model).check_supported(model, context_length)
