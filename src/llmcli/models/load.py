"""Local files → (model, tokenizer) on a device, ready for inference (the device, dtype and
threads are chosen in device.py)."""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from llmcli.config.settings import LoadSettings
from llmcli.errors import LlmcliError, ModelLoadError, UsageError
from llmcli.models.checkpoint import Checkpoint
from llmcli.models.device import (
    DTYPE_NAMES,
    choose_device,
    choose_dtype,
    configure_cpu_threads,
    gguf_float_dtype,
)
from llmcli.models.libraries import check_every_tensor_loaded, quiet_libraries
from llmcli.models.load_plan import plan_quantization
from llmcli.models.memory import (
    FitRequest,
    available_host_memory,
    context_length_of,
    estimate_weight_bytes,
    fits,
    format_bytes,
    free_memory,
    kv_bytes_per_token,
    measured_weight_bytes,
    native_mode,
)
from llmcli.models.quant import (
    bitsandbytes_config,
    bitsandbytes_request,
    check_quant_request,
    gguf_refusal,
    quant_label,
)
from llmcli.models.resolve import ResolvedModel

if TYPE_CHECKING:
    from llmcli.models.quantized import ExactCodes


@dataclass
class LoadedModel:
    model: Any  # a transformers PreTrainedModel
    tokenizer: Any  # a transformers tokenizer
    name: str
    device: torch.device
    dtype: torch.dtype
    generation_config: dict[str, Any]  # generation_config.json as written, for sampling defaults
    eos_token_ids: frozenset[int]
    context_length: int  # the context llmcli will use: the model's, or less (--ctx, or to fit memory)
    weight_bytes: int  # measured from the tensors in memory
    quant: str = "none"  # none, int8, int4-g64, int4-nf4, int4-fp4, or a pre-quantized checkpoint's method
    quant_backend: str = "none"  # native (llmcli's own kernels), bitsandbytes, or the checkpoint's
    kv_bytes_per_token: int = 0
    notes: tuple[str, ...] = ()  # things the user should hear about (a context lowered to fit)
    fast: bool | None = None  # --fast/--no-fast as asked; the engine decides what it means for it
    engine: str = "auto"  # --engine as asked: auto, native or transformers
    weights_file: Path | None = None  # the GGUF file read in place, which a server watches for changes

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.tokenizer, "chat_template", None))

    @property
    def vocab_size(self) -> int:
        """Width of the model's logits (the embedding may be padded past the tokenizer's size)."""
        return self.model.config.get_text_config().vocab_size

    @property
    def dtype_name(self) -> str:
        return DTYPE_NAMES.get(self.dtype, str(self.dtype).removeprefix("torch."))

    def memory_summary(self) -> str:
        return (
            f"weights in memory {format_bytes(self.weight_bytes)} ({self.dtype_name}, quant {self.quant}) "
            f"on {self.device} · KV cache {format_bytes(self.kv_bytes_per_token)}/token"
        )


def eos_ids(*sources: Any) -> frozenset[int]:
    """Every end-of-sequence id named anywhere: chat models often end turns with a token
    (e.g. <|im_end|>) that only the tokenizer or the generation config knows about."""
    ids: set[int] = set()
    for value in sources:
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(v for v in value if isinstance(v, int))
    return frozenset(ids)


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


def estimate_mode(settings: LoadSettings, config: dict[str, Any]) -> str:
    """How to size the weights: as quantized on load, or, for a checkpoint that comes quantized,
    as they are stored (it loads as it is)."""
    return "stored" if config.get("quantization_config") else settings.quant


def plan_context(
    resolved: ResolvedModel,
    settings: LoadSettings,
    config: dict[str, Any],
    device: torch.device,
    dtype: torch.dtype,
    native: tuple[str, int | None] | None = None,
) -> tuple[int, str | None]:
    """The context to use, checked against free memory before anything is loaded. `native`:
    (int8 or int4, its group) when llmcli quantizes with its own formats."""
    model_context = context_length_of(config)
    context = min(model_context, settings.context_length or model_context)
    limits = [
        b for b in (free_memory(device, offload=settings.offload), settings.max_memory) if b is not None
    ]
    budget = min(limits) if limits else None
    shapes = resolved.shapes
    if budget is None or not shapes:
        return context, None
    dtype_bytes = dtype.itemsize
    return fits(
        FitRequest(
            name=resolved.name,
            device=str(device),
            shapes=shapes,
            dtype_bytes=dtype_bytes,
            dtype_name=DTYPE_NAMES.get(dtype, str(dtype)),
            quant=native_mode(*native, shapes) if native else estimate_mode(settings, config),
            double_quant=settings.double_quant,
            kv_per_token=kv_bytes_per_token(config, dtype_bytes),
            context=context,
            context_given=settings.context_length is not None,
            budget=budget,
        )
    )


_EXPERT_TENSOR = re.compile(r"^(.*\.experts)\.(\d+)\.(.+)$")


def _check_every_expert_stored(folder: Path, config: dict[str, Any], names: set[str]) -> None:
    """A mixture of experts stored one expert per tensor (`….experts.7.up_proj.weight`) has
    every expert of every kind: transformers stacks them while loading and, one missing, fails
    without naming it."""
    experts = config.get("num_experts") or config.get("num_local_experts")
    if not isinstance(experts, int) or experts < 1:
        return
    groups: dict[tuple[str, str], set[int]] = {}
    for name in names:
        found = _EXPERT_TENSOR.match(name)
        if found:
            groups.setdefault((found.group(1), found.group(3)), set()).add(int(found.group(2)))
    for (prefix, suffix), present in sorted(groups.items()):
        absent = sorted(set(range(experts)) - present)
        if absent:
            tensor = f"{prefix}.{absent[0]}.{suffix}"
            raise ModelLoadError(
                f"{folder} lacks the tensor {tensor} (config.json names {experts} experts)",
                "the checkpoint is incomplete or not for this config: download it again",
            )


def prepare_device(
    settings: LoadSettings, device: torch.device, native_quant: bool = False, quiet: bool = True
) -> torch.dtype:
    """The dtype to load in, with libraries quieted (`quiet`: transformers is about to load) and
    CPU threads chosen. Native int8/int4 kernels are fast with bf16 activations only, so such a
    model computes in bf16."""
    if quiet:
        quiet_libraries()
    dtype = choose_dtype(settings.dtype, device)
    if native_quant and settings.dtype == "auto":
        dtype = torch.bfloat16
    if device.type == "cpu":
        configure_cpu_threads(settings.threads)
    return dtype


@dataclass
class LoadPlan:
    """What a load settles before any weight is read: shared by transformers' path and the lean
    one (lean_load.py)."""

    config: dict[str, Any]
    settings: LoadSettings  # --quant made concrete
    device: torch.device
    dtype: torch.dtype
    native_quant: str | None  # int8 or int4 when llmcli's own kernels quantize
    group: int | None  # int4's group size
    context: int
    context_note: str | None


def plan_load(resolved: ResolvedModel, settings: LoadSettings, quiet: bool = True) -> LoadPlan:
    config = resolved.config
    names: set[str] = set()
    for header in resolved.headers.values():  # a damaged file is named now, not crashed on later
        names |= set(header)
    _check_every_expert_stored(resolved.path, config, names)
    device = choose_device(settings.device)
    settings, native_quant, group = plan_quantization(settings, config, device.type, resolved)
    dtype = prepare_device(settings, device, native_quant=native_quant is not None, quiet=quiet)
    keeps_file_width = settings.dtype == "auto" and native_quant is None and device.type == "cpu"
    if resolved.source == "gguf" and keeps_file_width:
        dtype = gguf_float_dtype(resolved.gguf_type, device) or dtype
    check_quant_request(settings.quant, device.type, resolved.source, config, native=native_quant is not None)
    context, context_note = plan_context(
        resolved, settings, config, device, dtype, (native_quant, group) if native_quant else None
    )
    return LoadPlan(config, settings, device, dtype, native_quant, group, context, context_note)


def load_model(resolved: ResolvedModel, settings: LoadSettings, lean: bool = False) -> LoadedModel:
    """`lean`: read a Llama-family folder straight into the native engine's layout, without
    transformers (lean_load.py), where it can; its reason where it cannot is a note, and the
    load goes on through transformers."""
    lean_note, keep_tokenizer = None, False
    if lean:
        from llmcli.models.lean_load import lean_load

        outcome = lean_load(resolved, settings)
        if outcome.loaded is not None:
            return outcome.loaded
        lean_note, keep_tokenizer = outcome.note, outcome.keep_tokenizer
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from llmcli.models.gguf_direct import gguf_transformers_model

    plan = plan_load(resolved, settings)
    folder, config, device, dtype = resolved.path, plan.config, plan.device, plan.dtype
    settings, native_quant, group = plan.settings, plan.native_quant, plan.group
    context, context_note = plan.context, plan.context_note
    generation_config = resolved.generation_config  # checked before transformers reads it
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
        if resolved.read_in_place:  # a GGUF file read in place: no safetensors to read
            refuse_for_gguf(settings, device, native_quant)
            tensors_of = functools.partial(resolved.tensors, dtype, device)
            from_pretrained = functools.partial(gguf_transformers_model, folder, tensors_of, dtype, device)
        try:
            model, info = from_pretrained(attn_implementation="sdpa", output_loading_info=True)
        except ValueError as error:
            if not _lacks_sdpa(error):
                raise
            # An architecture without SDPA support: its own attention.
            model, info = from_pretrained(output_loading_info=True)
    except (ValueError, OSError, KeyError, ImportError) as error:
        raise _load_error(resolved, error) from error
    except torch.OutOfMemoryError as error:
        raise out_of_memory_error(resolved, settings, config, device, dtype) from error
    except RuntimeError as error:  # transformers' own checks of the tensors against the config
        raise _load_error(resolved, error) from error
    check_every_tensor_loaded(resolved.path, info)
    if keep_tokenizer and lean_note is not None:
        from llmcli.models.tokenizer_capture import capture

        if capture(tokenizer, folder):
            lean_note += "; llmcli keeps the tokenizer transformers built, so later starts are lean"
    model.eval()
    quant = quant_label(settings.quant, settings.quant_type, config)
    quant_backend = "bitsandbytes" if settings.quant != "none" else "none"
    if native_quant is not None:
        quant, quant_backend = quantize_natively(model, resolved, native_quant, group), "native"
    elif config.get("quantization_config"):
        quant_backend = quant
    notes = [note for note in (lean_note, context_note) if note]
    if _dequantized_mxfp4(model, config):
        notes.append(
            f"MXFP4 experts dequantized to {DTYPE_NAMES.get(dtype, dtype)}: transformers has no MXFP4 kernel "
            f"on {device.type} here, so they take 4-8x their size on disk in memory"
        )
        quant, quant_backend = "none", "none"
    dtype_bytes = dtype.itemsize
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        name=resolved.name,
        device=device,
        dtype=dtype,
        generation_config=generation_config,
        eos_token_ids=eos_ids(
            generation_config.get("eos_token_id"),
            getattr(model.generation_config, "eos_token_id", None),
            getattr(model.config, "eos_token_id", None),
            tokenizer.eos_token_id,
        ),
        context_length=context,
        weight_bytes=measured_weight_bytes(model),
        quant=quant,
        quant_backend=quant_backend,
        kv_bytes_per_token=kv_bytes_per_token(config, dtype_bytes),
        notes=tuple(notes),
        fast=settings.fast,
        engine=settings.engine,
        weights_file=resolved.gguf_file,
    )


def quantize_natively(model: Any, resolved: ResolvedModel, kind: str, group: int | None) -> str:
    """`model` quantized in place by llmcli's own int8/int4; the label. A GGUF file's 4-bit
    layers take its own blocks, not requantized weights, and its wider ones int8 (read from the
    blocks where the file is read in place)."""
    from llmcli.models.quantized import quantize_model

    exact = resolved.exact_codes() if resolved.source == "gguf" else None
    return quantize_model(model, kind, group, exact)


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


def exact_codes_of(folder: Path) -> ExactCodes | None:
    """A GGUF file's 4-bit blocks as int4 codes: read from the file itself where it is read in
    place, else from those written beside an older conversion."""
    return Checkpoint(folder.name, folder, "gguf").exact_codes()


def _dequantized_mxfp4(model: Any, config: dict[str, Any]) -> bool:
    """Whether a checkpoint of MXFP4 experts (gpt-oss) was dequantized while loading: transformers
    does so, with a warning of its own, where it has no kernel for them."""
    method = (config.get("quantization_config") or {}).get("quant_method")
    return method == "mxfp4" and not any(type(m).__name__.startswith("Mxfp4") for m in model.modules())


def _lacks_sdpa(error: ValueError) -> bool:
    """transformers' refusal of SDPA for an architecture that has none (gpt-oss, for its sinks)."""
    return any(word in str(error).lower() for word in ("sdpa", "scaled_dot_product_attention"))


def load_random(config_spec: str, settings: LoadSettings) -> LoadedModel:
    """A model built from a config alone, with random weights: for benchmarks, where speed does
    not depend on weight values, and no weights need downloading. `config_spec` is a config.json,
    a folder holding one, or a Hub id whose config.json is fetched (cache first)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config_file = _config_file(config_spec)
    config = json.loads(config_file.read_text())
    device = choose_device(settings.device)
    settings, native_quant, _ = plan_quantization(settings, config, device.type, None)
    if settings.quant != "none" and native_quant is None:
        raise UsageError(
            f"--quant {settings.quant} with --random-weights needs a model the native engine runs",
            "random weights are quantized by llmcli's own int8/int4 only",
        )
    dtype = prepare_device(settings, device, native_quant=native_quant is not None)
    hf_config = AutoConfig.from_pretrained(
        config_file.parent if config_file.name == "config.json" else config_file
    )
    torch.manual_seed(0)
    try:
        with torch.device(device):
            try:
                model = AutoModelForCausalLM.from_config(hf_config, dtype=dtype, attn_implementation="sdpa")
            except ValueError as error:
                if not _lacks_sdpa(error):
                    raise
                model = AutoModelForCausalLM.from_config(hf_config, dtype=dtype, attn_implementation="eager")
    except torch.OutOfMemoryError as error:
        raise LlmcliError(
            f"out of memory building {config_spec} on {device} in {DTYPE_NAMES.get(dtype)}"
        ) from error
    model.eval()
    quant = "none"
    if native_quant is not None:
        from llmcli.models.quantized import quantize_model

        quant = quantize_model(model, native_quant)
    model_context = context_length_of(config)
    return LoadedModel(
        model=model,
        tokenizer=None,
        name=f"{config_spec} (random weights)",
        device=device,
        dtype=dtype,
        generation_config={},
        eos_token_ids=frozenset(),
        context_length=min(model_context, settings.context_length or model_context),
        weight_bytes=measured_weight_bytes(model),
        quant=quant,
        quant_backend="native" if native_quant else "none",
        kv_bytes_per_token=kv_bytes_per_token(config, dtype.itemsize),
        fast=settings.fast,
        engine=settings.engine,
    )


def _config_file(spec: str) -> Path:
    path = Path(spec).expanduser()
    if path.is_file():
        return path
    if (path / "config.json").is_file():
        return path / "config.json"
    from llmcli.models.resolve import hub_config_file

    return hub_config_file(spec)


def out_of_memory_error(
    resolved: ResolvedModel,
    settings: LoadSettings,
    config: dict[str, Any],
    device: torch.device,
    dtype: torch.dtype,
) -> LlmcliError:
    """The fit check passed but the device ran out anyway (other processes, fragmentation):
    the numbers we had, and what to try."""
    if device.type == "cuda":
        torch.cuda.empty_cache()
    free = free_memory(device)
    shapes = resolved.shapes
    dtype_bytes = dtype.itemsize
    needed = estimate_weight_bytes(
        shapes, dtype_bytes, estimate_mode(settings, config), settings.double_quant, device.type
    )
    stronger = {"none": "--quant int8 or --quant int4, ", "int8": "--quant int4, "}.get(settings.quant, "")
    return LlmcliError(
        f"out of memory loading {resolved.name} on {device}: its weights need about {format_bytes(needed)}"
        + (f" and {format_bytes(free)} is free now" if free is not None else ""),
        f"try {stronger}--offload, or free the device",
    )


def _load_error(resolved: ResolvedModel, error: Exception) -> LlmcliError:
    text = str(error)
    if "trust_remote_code" in text:
        return ModelLoadError(
            f"{resolved.name} needs code from its repository to load",
            "pass --trust-remote-code only if you trust its author",
        )
    first_line = text.strip().splitlines()[0] if text.strip() else type(error).__name__
    return ModelLoadError(f"cannot load {resolved.name} from {resolved.path}: {first_line}")
