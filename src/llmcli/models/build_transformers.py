"""The transformers builder: a checkpoint loaded by transformers' from_pretrained (or, for a
GGUF file read in place, transformers' model filled from the file's tensors), for what the
native builder does not build. transformers is imported inside `build` only, when this builder
is chosen: an in-process native call never imports it."""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

import torch

from llmcli.config.settings import LoadSettings
from llmcli.errors import LlmcliError, ModelLoadError, UsageError
from llmcli.models.built import Built
from llmcli.models.device import DTYPE_NAMES
from llmcli.models.libraries import check_every_tensor_loaded, quiet_libraries
from llmcli.models.memory import available_host_memory
from llmcli.models.quant import bitsandbytes_config, bitsandbytes_request, gguf_refusal, quant_label

if TYPE_CHECKING:
    from llmcli.models.build_native import Refusal
    from llmcli.models.checkpoint import Checkpoint
    from llmcli.models.load_plan import LoadPlan


def build(checkpoint: Checkpoint, plan: LoadPlan, refusal: Refusal) -> Built:
    """The model and tokenizer through transformers, in the plan's dtype and placement. `refusal`:
    why the native builder did not build it (its note, and whether to keep the tokenizer built
    here for later lean starts). A device out of memory is left to the caller."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from llmcli.models.gguf_direct import gguf_transformers_model

    quiet_libraries()
    folder, config, device, dtype = checkpoint.path, plan.config, plan.device, plan.dtype
    settings, native_quant = plan.settings, plan.native_quant
    common = {"trust_remote_code": settings.trust_remote_code}
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, **common)
        from_pretrained = functools.partial(
            AutoModelForCausalLM.from_pretrained,
            folder,
            dtype=dtype,
            use_safetensors=None if settings.allow_pickle else True,
            ignore_mismatched_sizes=True,  # so the tensor is named (check_every_tensor_loaded)
            **(quantization(settings, dtype) if native_quant is None else {}),
            **placement(device, settings),
            **common,
        )
        if checkpoint.read_in_place:  # a GGUF file read in place: no safetensors to read
            refuse_for_gguf(settings, device, native_quant)
            tensors_of = functools.partial(checkpoint.tensors, dtype, device)
            from_pretrained = functools.partial(gguf_transformers_model, folder, tensors_of, dtype, device)
        try:
            model, info = from_pretrained(attn_implementation="sdpa", output_loading_info=True)
        except ValueError as error:
            if not lacks_sdpa(error):
                raise
            # An architecture without SDPA support: its own attention.
            model, info = from_pretrained(output_loading_info=True)
    except (ValueError, OSError, KeyError, ImportError) as error:
        raise _load_error(checkpoint, error) from error
    except torch.OutOfMemoryError:
        raise  # a RuntimeError too, but the pipeline says what to try (out_of_memory_error)
    except RuntimeError as error:  # transformers' own checks of the tensors against the config
        raise _load_error(checkpoint, error) from error
    check_every_tensor_loaded(folder, info)
    fallback_note = refusal.note
    if refusal.keep_tokenizer and fallback_note is not None:
        from llmcli.models.tokenizer_capture import capture

        if capture(tokenizer, folder):
            fallback_note += "; llmcli keeps the tokenizer transformers built, so later starts are lean"
    model.eval()
    quant = quant_label(settings.quant, settings.quant_type, config)
    quant_backend = "bitsandbytes" if settings.quant != "none" else "none"
    if native_quant is None and config.get("quantization_config"):
        quant_backend = quant
    notes = []
    if _dequantized_mxfp4(model, config):
        notes.append(
            f"MXFP4 experts dequantized to {DTYPE_NAMES.get(dtype, dtype)}: transformers has no MXFP4 kernel "
            f"on {device.type} here, so they take 4-8x their size on disk in memory"
        )
        quant, quant_backend = "none", "none"
    return Built(model, tokenizer, fallback_note, notes, quant, quant_backend)


def quantization(settings: LoadSettings, dtype: torch.dtype) -> dict[str, Any]:
    """from_pretrained's quantization_config, only when bitsandbytes quantizes on load: passing
    None would switch off the quantization a pre-quantized checkpoint's config asks for."""
    quant, quant_type = bitsandbytes_request(settings.quant, settings.quant_type)
    config = bitsandbytes_config(quant, quant_type, settings.double_quant, compute_dtype=dtype)
    return {"quantization_config": config} if config is not None else {}


def placement(device: torch.device, settings: LoadSettings) -> dict[str, Any]:
    """Where the weights go: one device, or spread by accelerate over several GPUs (and, with
    --offload, CPU memory), each within its free memory."""
    if device.type != "cuda":
        return {"device_map": str(device)}
    gpus = [device.index] if device.index is not None else list(range(torch.cuda.device_count()))
    if len(gpus) == 1 and not settings.offload:
        return {"device_map": f"cuda:{gpus[0]}"}
    max_memory: dict[Any, int] = {i: int(torch.cuda.mem_get_info(i)[0] * 0.9) for i in gpus}
    if settings.max_memory:
        max_memory = {i: min(free, settings.max_memory // len(gpus)) for i, free in max_memory.items()}
    if settings.offload:
        max_memory["cpu"] = int((available_host_memory() or 0) * 0.9)
    return {"device_map": "auto", "max_memory": max_memory}


def refuse_for_gguf(settings: LoadSettings, device: torch.device, native_quant: str | None) -> None:
    """What a GGUF file read in place cannot be loaded with through transformers' path, refused
    rather than dropped: bitsandbytes quantization and weights spread by accelerate."""
    if native_quant is None and bitsandbytes_request(settings.quant, settings.quant_type)[0] != "none":
        raise gguf_refusal(settings.quant)
    if placement(device, settings).get("device_map") == "auto":
        raise UsageError(
            "a GGUF file loads onto one device: --offload and several GPUs are for safetensors models",
            "pass --device cuda:0, or drop --offload",
        )


def _dequantized_mxfp4(model: Any, config: dict[str, Any]) -> bool:
    """Whether a checkpoint of MXFP4 experts (gpt-oss) was dequantized while loading: transformers
    does so, with a warning of its own, where it has no kernel for them."""
    method = (config.get("quantization_config") or {}).get("quant_method")
    return method == "mxfp4" and not any(type(m).__name__.startswith("Mxfp4") for m in model.modules())


def lacks_sdpa(error: ValueError) -> bool:
    """transformers' refusal of SDPA for an architecture that has none (gpt-oss, for its sinks)."""
    return any(word in str(error).lower() for word in ("sdpa", "scaled_dot_product_attention"))


def _load_error(checkpoint: Checkpoint, error: Exception) -> LlmcliError:
    text = str(error)
    if "trust_remote_code" in text:
        return ModelLoadError(
            f"{checkpoint.name} needs code from its repository to load",
            "pass --trust-remote-code only if you trust its author",
        )
    first_line = text.strip().splitlines()[0] if text.strip() else type(error).__name__
    return ModelLoadError(f"cannot load {checkpoint.name} from {checkpoint.path}: {first_line}")
