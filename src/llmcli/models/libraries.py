"""What loading through transformers needs around it, wherever it runs (a load, a GGUF
conversion, a GGUF tokenizer's conversion): the libraries kept quiet, and a tensor transformers
filled with random values refused. transformers is imported inside, only when it runs."""

from __future__ import annotations

import sys
import warnings
from pathlib import Path
from typing import Any

from llmcli.errors import ModelLoadError
from llmcli.models.quant import silence_bitsandbytes


def quiet_libraries() -> None:
    """Our own progress and errors are the only ones the user should see."""
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    warnings.filterwarnings("ignore", module="transformers")
    warnings.filterwarnings("ignore", module="bitsandbytes")
    # inductor's advice to enable TF32, printed whenever something compiles in fp32 on a GPU.
    warnings.filterwarnings("ignore", message=".*TensorFloat32.*")
    silence_bitsandbytes()  # also for checkpoints that come quantized, without --quant
    if not sys.stderr.isatty():
        from huggingface_hub.utils import disable_progress_bars

        disable_progress_bars()


def check_every_tensor_loaded(where: Path, info: dict[str, Any]) -> None:
    """transformers fills a tensor the checkpoint lacks with random values and goes on (a
    warning we keep quiet): a model missing an expert or a layer would answer garbage. One line
    naming the tensor instead."""
    missing = sorted(info.get("missing_keys") or [])
    mismatched = sorted(info.get("mismatched_keys") or [], key=str)  # (name, stored shape, wanted shape)
    if mismatched:
        name, stored, wanted = [*mismatched[0], None, None][:3]
        raise ModelLoadError(
            f"{where}: tensor {name} has the shape {stored}, and the config asks for {wanted}",
            "the checkpoint and its config.json do not match: download it again",
        )
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise ModelLoadError(
            f"{where} lacks the tensor {missing[0]}{more} that its config's architecture needs",
            "the checkpoint is incomplete or not for this config: download it again",
        )
