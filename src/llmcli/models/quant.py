"""Quantized loading: llmcli's own weight-only int8/int4 for the native engine, and bitsandbytes
(INT8 as LLM.int8, INT4 as NF4 or FP4) for everything the native engine does not run.

`--quant int8|int4` on a model the native engine runs (the Llama family, on CPU or CUDA, one
device) quantizes with llmcli's own formats, which decode faster; elsewhere, or with
`--engine transformers`, it goes through bitsandbytes, as does `--quant nf4|fp4` always.

Checks come first, so that a request that cannot work fails in one clear line before anything
slow: bitsandbytes missing, a device it does not run on, a GGUF file (already quantized by its
own scheme), or a checkpoint that is already quantized.
"""

from __future__ import annotations

import logging
import warnings
from typing import Any

from llmcli.errors import LlmcliError, UsageError
from llmcli.models.families import family_of_config

NATIVE_QUANTS = ("int8", "int4")
# int4's group for a GGUF file: its own block size, so its 4-bit blocks come back on the same grid.
GGUF_INT4_GROUP = 32
INT4_GROUPS = (128, 64, 32)  # preferred first; the largest that divides every layer is used


def pick_int4_group(widths: set[int]) -> int:
    """The largest preferred int4 group size that divides every input width to quantize
    (SmolLM2's 576 takes 64, not 128)."""
    for group in INT4_GROUPS:
        if all(width % group == 0 for width in widths):
            return group
    raise ValueError(f"no int4 group size in {INT4_GROUPS} divides the layer widths {sorted(widths)}")


def auto_quant(quant: str, source: str, checkpoint: Any) -> tuple[str, int | None]:
    """--quant auto (the default): a GGUF file's weights stay as compact as it stored them
    (4-bit → int4, 5–8-bit → int8), anything else loads as it is. Returns the concrete request
    and int4's group size: 32 for a GGUF file (its own block size, so 4-bit blocks come back on
    the same grid), else None (llmcli's pick). `checkpoint`: the model's (checkpoint.py), whose
    weight kind is asked only here."""
    if quant == "auto":
        kind = checkpoint.weight_kind if source == "gguf" else None
        quant = kind if kind in NATIVE_QUANTS else "none"
    if quant == "int4" and source == "gguf":
        return quant, GGUF_INT4_GROUP
    return quant, None


def native_quant_kind(
    quant: str, engine: str, offload: bool, device_type: str, config: dict[str, Any]
) -> str | None:
    """int8 or int4 when llmcli quantizes with its own formats; None when bitsandbytes does (or
    nothing is quantized)."""
    if quant not in NATIVE_QUANTS or engine == "transformers" or offload:
        return None
    if device_type not in ("cpu", "cuda"):
        return None
    row = family_of_config(config)
    if row is None:
        return None
    if row.experts is not None and device_type != "cpu":  # quantized on a CPU only (families.py)
        raise UsageError(
            f"--quant {quant}: a mixture of experts' experts are quantized for a CPU only so far (on a "
            "GPU they are gathered by index, which needs an int8/int4 kernel not written yet)",
            "drop --quant, or add --device cpu",
        )
    return quant


def bitsandbytes_request(quant: str, quant_type: str) -> tuple[str, str]:
    """(--quant, --quant-type) as bitsandbytes sees them: nf4 and fp4 are its int4 types."""
    return ("int4", quant) if quant in ("nf4", "fp4") else (quant, quant_type)


def check_quant_request(
    quant: str, device_type: str, source: str, config: dict[str, Any], *, native: bool = False
) -> None:
    """Refuse what cannot work, in one line each."""
    if quant == "none":
        return
    if source == "gguf" and not native:
        raise gguf_refusal(quant)
    existing = config.get("quantization_config")
    if existing:
        method = existing.get("quant_method", "unknown") if isinstance(existing, dict) else "unknown"
        raise UsageError(
            f"--quant {quant}: this checkpoint is already quantized ({method})",
            "drop --quant: it loads as it is",
        )
    if native:
        return  # torch's own kernels: nothing more to check
    row = family_of_config(config)
    if row is not None and row.experts is not None:
        raise UsageError(
            f"--quant {quant}: this mixture of experts keeps its experts in stacked tensors, which "
            "bitsandbytes does not quantize (the experts would stay unquantized)",
            "llmcli's own int8/int4 do, on a CPU with the native engine; else drop --quant",
        )
    silence_bitsandbytes()  # its import logs about optional kernels: planned before libraries are quieted
    try:
        import bitsandbytes  # noqa: F401  (a broken install fails here too, not halfway through loading)
    except ImportError:
        raise LlmcliError(
            f"--quant {quant} needs the bitsandbytes package", "install it with `pip install 'llmcli[quant]'`"
        ) from None
    if device_type not in ("cuda", "cpu"):
        raise LlmcliError(
            f"--quant {quant}: bitsandbytes does not run on {device_type}", "use --device cuda or cpu"
        )


def gguf_refusal(quant: str) -> UsageError:
    return UsageError(
        f"--quant {quant} (bitsandbytes) does not apply to a GGUF file",
        "use --quant int8 or int4 (llmcli's own, on the native engine), or drop --quant",
    )


def bitsandbytes_only(quant: str, engine: str) -> bool:
    """A request only bitsandbytes can serve, known before the model is read."""
    return quant in ("nf4", "fp4") or (quant not in ("none", "auto") and engine == "transformers")


def bitsandbytes_config(quant: str, quant_type: str, double_quant: bool, compute_dtype: Any) -> Any:
    """The BitsAndBytesConfig for a request, or None for no quantization."""
    if quant == "none":
        return None
    from transformers import BitsAndBytesConfig

    silence_bitsandbytes()
    if quant == "int8":
        return BitsAndBytesConfig(load_in_8bit=True)
    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type=quant_type,
        bnb_4bit_use_double_quant=double_quant,
        bnb_4bit_compute_dtype=compute_dtype,
    )


def silence_bitsandbytes() -> None:
    """bitsandbytes logs a warning per matmul on CPU ("inputs will be cast …") and about optional
    kernels; none of it is for the user."""
    logging.getLogger("bitsandbytes").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", module="bitsandbytes")


def quant_label(quant: str, quant_type: str, config: dict[str, Any]) -> str:
    """What `--json` and /show call the weights' format: none, int8, int4-nf4, int4-fp4, or the
    method of a checkpoint that came quantized (e.g. "gptq", "bitsandbytes")."""
    existing = config.get("quantization_config")
    if quant == "none" and isinstance(existing, dict):
        return str(existing.get("quant_method", "prequantized"))
    quant, quant_type = bitsandbytes_request(quant, quant_type)
    return f"int4-{quant_type}" if quant == "int4" else quant
