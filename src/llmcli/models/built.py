"""What a builder hands the load pipeline (load.py): the model and its tokenizer, before llmcli's
own quantization, with what the user should hear about how it was built. Its own module, so
that both builders (build_native.py, build_transformers.py) and the pipeline share it without
importing each other."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Built:
    model: Any  # a transformers PreTrainedModel, or lean_model's LeanCausalLM
    tokenizer: Any  # a transformers tokenizer, or a LeanTokenizer
    fallback_note: str | None = None  # why the native builder did not build it, as the user reads it
    notes: list[str] = field(default_factory=list)  # said after the context's note (MXFP4 dequantized)
    quant: str = "none"  # the label before llmcli's own quantization (bitsandbytes', or a stored method)
    quant_backend: str = "none"
