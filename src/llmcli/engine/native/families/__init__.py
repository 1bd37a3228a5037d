"""The model families the native engine runs, picked by architecture.

Which architectures run natively is declared once, torch-free, in models/quant.py
(`NATIVE_FAMILIES`: architecture → family), so the loader can ask before importing torch; here
each family name finds its module. Adding a family is a module that gives `check_supported` and
`weights`, and its architectures in that table.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

from llmcli.engine.native.families import gemma3, gpt_oss, llama, moe, phi3
from llmcli.engine.native.families.base import NotSupported
from llmcli.models.quant import NATIVE_FAMILIES

FAMILIES: dict[str, ModuleType] = {
    "llama": llama,
    "moe": moe,
    "phi3": phi3,
    "gemma3": gemma3,
    "gpt_oss": gpt_oss,
}


def family_of(model: Any) -> ModuleType:
    # A lean-loaded model (models/lean_model.py) names the architecture its tensors are of.
    name = getattr(model, "architecture", None) or type(model).__name__
    family = NATIVE_FAMILIES.get(name)
    if family is None:
        families = "Llama, Phi-3, Gemma 2 and 3, gpt-oss, a sparse MoE"
        raise NotSupported(f"{name} is not in a family the native engine runs ({families})")
    return FAMILIES[family]


def check_supported(model: Any, context_length: int) -> None:
    """Raise NotSupported unless `model` runs on the native engine; the message says why."""
    family = family_of(model)
    family.check_supported(model, context_length)
