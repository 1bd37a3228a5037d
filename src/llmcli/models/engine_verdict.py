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
    name = RUNTIMES[row.runtime]
    if row.native_when_asked:
        return {
            "auto": "transformers",
            "why": f"the native engine runs {name} only where --engine native asks: its recurrent "
            "state is not yet kept across turns or batched",
        }
    return {"auto": "native", "why": f"the native engine's {name} family"}
