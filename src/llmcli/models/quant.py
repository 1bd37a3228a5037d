"""Quantized loading through bitsandbytes: INT8 (LLM.int8) and INT4 (NF4 or FP4).

Checks come first, so that a request that cannot work fails in one clear line before anything
slow: bitsandbytes missing, a device it does not run on, a GGUF file (already quantized by its
own scheme), or a checkpoint that is already quantized.
"""

from __future__ import annotations

import logging
from typing import Any

from llmcli.errors import LlmcliError, UsageError


def check_quant_request(quant: str, device_type: str, source: str, config: dict[str, Any]) -> None:
    """Refuse what cannot work, in one line each."""
    if quant == "none":
        return
    if source == "gguf":
        raise gguf_refusal(quant)
    existing = config.get("quantization_config")
    if existing:
        method = existing.get("quant_method", "unknown") if isinstance(existing, dict) else "unknown"
        raise UsageError(
            f"--quant {quant}: this checkpoint is already quantized ({method})",
            "drop --quant: it loads as it is",
        )
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
        f"--quant {quant} does not apply to a GGUF file: it is already quantized in its own format",
        "drop --quant (llmcli dequantizes GGUF to fp16), or quantize a safetensors model instead",
    )


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


def quant_label(quant: str, quant_type: str, config: dict[str, Any]) -> str:
    """What `--json` and /show call the weights' format: none, int8, int4-nf4, int4-fp4, or the
    method of a checkpoint that came quantized (e.g. "gptq", "bitsandbytes")."""
    existing = config.get("quantization_config")
    if quant == "none" and isinstance(existing, dict):
        return str(existing.get("quant_method", "prequantized"))
    return f"int4-{quant_type}" if quant == "int4" else quant
