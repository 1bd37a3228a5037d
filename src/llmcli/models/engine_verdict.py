"""Which engine `--engine auto` runs a checkpoint's architecture on, and why, as `models show`
says it: from the families table alone (no torch). Settings decided at load time (bitsandbytes,
--offload, a checkpoint that comes quantized) can still send a native family to transformers;
the load says so then."""

from __future__ import annotations

from llmcli.models.families import RUNTIMES, family


def engine_under_auto(architecture: str | None) -> dict[str, str]:
    """{"auto": "native" or "transformers", "why": one line}."""
    row = family(architecture)
    if row is None:
        return {"auto": "transformers", "why": f"the native engine does not run {architecture or 'it'}"}
    return {"auto": "native", "why": f"the native engine runs {architecture} ({RUNTIMES[row.runtime]})"}
