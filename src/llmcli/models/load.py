"""A checkpoint → (model, tokenizer) on a device, ready for inference, through one pipeline:
plan (load_plan.py) → choose the builder (build_native.choose) → build (build_native.py or
build_transformers.py) → llmcli's own quantization → one LoadedModel. The device, dtype and
threads are chosen in device.py."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from llmcli.config.settings import LoadSettings
from llmcli.errors import LlmcliError, MemoryShortage, UsageError
from llmcli.models import build_native, build_transformers, cpu_kernels
from llmcli.models.build_native import NativeChoice, Refusal
from llmcli.models.build_transformers import lacks_sdpa
from llmcli.models.checkpoint import Checkpoint
from llmcli.models.device import DTYPE_NAMES, choose_device, configure_cpu_threads
from llmcli.models.gguf_finite import check_finite
from llmcli.models.lean_config import DamagedCheckpoint, LeanUnsupported
from llmcli.models.libraries import quiet_libraries
from llmcli.models.load_plan import LoadPlan, estimate_mode, plan_dtype, plan_load, plan_quantization
from llmcli.models.memory import (
    context_length_of,
    estimate_weight_bytes,
    format_bytes,
    free_memory,
    kv_bytes_per_token,
    measured_weight_bytes,
)
from llmcli.models.vision.load import VisionSource, vision_source

if TYPE_CHECKING:
    from llmcli.models.block_linear import BlockKernels
    from llmcli.models.built import Built
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
    vision: VisionSource | None = None  # its vision part, where it reads images (built on the first)
    fingerprint: str | None = None  # its files' identity (fingerprint.py): the prompt cache's key

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


def load_model(
    checkpoint: Checkpoint, settings: LoadSettings, lean: bool = False, mtp: bool = False
) -> LoadedModel:
    """The one load pipeline: plan (pure, over the checkpoint) → choose the builder → build →
    quantize → one LoadedModel. `lean`: the native builder builds a family the native engine runs,
    without transformers, where it can (build_native.py); its reason where it cannot is a note,
    and transformers' builder builds with the same plan. `mtp`: the native builder reads the
    checkpoint's MTP module too (--speculative mtp)."""
    plan = plan_load(checkpoint, settings)
    if checkpoint.read_in_place:  # a NaN or Inf scale named before any weight is used
        check_finite(checkpoint.gguf_table)
    generation_config = checkpoint.generation_config  # checked before either builder reads the folder
    choice = build_native.choose(checkpoint, plan, settings) if lean else Refusal()
    from_blocks = plan.native_quant is not None and checkpoint.source == "gguf"
    exact = checkpoint.exact_codes() if from_blocks else None  # read once: both builders and the quantizer
    try:
        built, choice = _build(checkpoint, plan, choice, exact, mtp)
    except torch.OutOfMemoryError as error:
        raise out_of_memory_error(checkpoint, plan.settings, plan.config, plan.device, plan.dtype) from error
    quant, quant_backend = built.quant, built.quant_backend
    if plan.native_quant is not None:
        kernels = _block_kernels(checkpoint, settings, plan) if exact is not None else None
        quant = _quantized(built.model, plan.native_quant, plan.group, exact, kernels)
        quant_backend = "native"
    elif width := _FILE_WIDTHS.get(plan.dtype):  # a 16-bit file kept in its own width
        kernels = _block_kernels(checkpoint, settings, plan, width)
        if kernels is not None:
            quant, quant_backend = _quantized(built.model, "blocks", None, None, kernels), "native"
    if quant.startswith("gguf-blocks") and plan.device.type == "cpu":  # its steps are the kernels' products
        from llmcli.models.cpu_kernels import run_on_kernels

        run_on_kernels(torch.get_num_threads())
    if isinstance(choice, NativeChoice):
        build_native.after_quantize(built, choice, plan, checkpoint.name)
    model, tokenizer = built.model, built.tokenizer
    kernels_note = cpu_kernels.load_note(plan.device, checkpoint.source == "gguf")
    notes = [note for note in (built.fallback_note, plan.context_note, *built.notes, kernels_note) if note]
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        name=checkpoint.name,
        device=plan.device,
        dtype=plan.dtype,
        generation_config=generation_config,
        eos_token_ids=eos_ids(
            generation_config.get("eos_token_id"),
            getattr(model.generation_config, "eos_token_id", None),
            getattr(model.config, "eos_token_id", None),
            tokenizer.eos_token_id,
        ),
        context_length=plan.context,
        weight_bytes=measured_weight_bytes(model),
        quant=quant,
        quant_backend=quant_backend,
        kv_bytes_per_token=kv_bytes_per_token(plan.config, plan.dtype.itemsize),
        notes=tuple(notes),
        fast=plan.settings.fast,
        engine=plan.settings.engine,
        weights_file=checkpoint.gguf_file,
        vision=_vision(checkpoint, plan, tokenizer, model),
    )


def _vision(checkpoint: Checkpoint, plan: LoadPlan, tokenizer: Any, model: Any) -> VisionSource | None:
    """The checkpoint's vision part, where llmcli reads images of its kind (vision/load.py)."""
    gguf = None
    if checkpoint.source == "gguf":  # its vision part is a file of its own (mmproj), found or named
        gguf = (checkpoint.gguf_file or checkpoint.path, plan.settings.mmproj)
    elif plan.settings.mmproj:
        raise UsageError("--mmproj names a GGUF model's vision part: this model is not a GGUF file")
    architecture, folder = checkpoint.architecture, checkpoint.path
    return vision_source(architecture, folder, plan.dtype, plan.device, tokenizer, model.config, gguf)


def _build(
    checkpoint: Checkpoint,
    plan: LoadPlan,
    choice: NativeChoice | Refusal,
    exact: ExactCodes | None,
    mtp: bool = False,
) -> tuple[Built, NativeChoice | Refusal]:
    """The model from the builder chosen, and the choice as it stands: a reason the native
    builder finds only while reading the files (a tensor they lack, an activation or RoPE it does
    not compute) makes transformers' builder build instead, with the same plan."""
    if isinstance(choice, NativeChoice):
        _configure_threads(plan)
        try:
            return build_native.build(checkpoint, plan, choice, exact, mtp), choice
        except DamagedCheckpoint:
            choice = Refusal()
        except LeanUnsupported as why:
            choice = build_native.note_for(why)
    _configure_threads(plan)
    return build_transformers.build(checkpoint, plan, choice), choice


def _configure_threads(plan: LoadPlan) -> None:
    """CPU threads chosen right before each build (one per core free now: busy_cores.py)."""
    if plan.device.type == "cpu":
        configure_cpu_threads(plan.settings.threads)


# A 16-bit GGUF file's type, by the dtype a load holds it in (its own width).
_FILE_WIDTHS = {torch.float16: "F16", torch.bfloat16: "BF16"}


def _block_kernels(
    checkpoint: Checkpoint, settings: LoadSettings, plan: LoadPlan, type_name: str | None = None
) -> BlockKernels | None:
    """llmcli's compiled kernels (on a GPU, gguf_cuda's Triton ones), where they multiply a GGUF
    file's layers in its own blocks (for --quant auto: int4 or int8 named asks for llmcli's
    requantized layers), for the files load_plan.block_types says; `type_name`: only where they
    take that type (a 16-bit file's F16 or BF16, held in the file's width)."""
    from llmcli.models.load_plan import block_types

    types = block_types(checkpoint, settings.quant, plan.device.type)
    if not types or (type_name is not None and type_name not in types):
        return None
    if plan.device.type == "cuda":
        from llmcli.models.gguf_cuda import KERNELS

        return KERNELS
    from llmcli.models.cpu_kernels import kernels

    return kernels()


def _quantized(
    model: Any,
    kind: str,
    group: int | None = None,
    exact: ExactCodes | None = None,
    kernels: BlockKernels | None = None,
) -> str:
    """`model` quantized in place by llmcli's own int8/int4; the label. A GGUF file's 4-bit
    layers take its own blocks (`exact`), not requantized weights, and its wider ones int8 (read
    from the blocks where the file is read in place)."""
    from llmcli.models.quantized import quantize_model

    return quantize_model(model, kind, group, exact, kernels)


def exact_codes_of(folder: Path) -> ExactCodes | None:
    """A GGUF file's 4-bit blocks as int4 codes: read from the file itself where it is read in
    place, else from those written beside an older conversion."""
    return Checkpoint(folder.name, folder, "gguf").exact_codes()


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
    quiet_libraries()
    dtype = plan_dtype(settings, device, native_quant)
    if device.type == "cpu":
        configure_cpu_threads(settings.threads)
    hf_config = AutoConfig.from_pretrained(
        config_file.parent if config_file.name == "config.json" else config_file
    )
    torch.manual_seed(0)
    try:
        with torch.device(device):
            try:
                model = AutoModelForCausalLM.from_config(hf_config, dtype=dtype, attn_implementation="sdpa")
            except ValueError as error:
                if not lacks_sdpa(error):
                    raise
                model = AutoModelForCausalLM.from_config(hf_config, dtype=dtype, attn_implementation="eager")
    except torch.OutOfMemoryError as error:
        raise LlmcliError(
            f"out of memory building {config_spec} on {device} in {DTYPE_NAMES.get(dtype)}"
        ) from error
    model.eval()
    quant = _quantized(model, native_quant) if native_quant is not None else "none"
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
    checkpoint: Checkpoint,
    settings: LoadSettings,
    config: dict[str, Any],
    device: torch.device,
    dtype: torch.dtype,
) -> MemoryShortage:
    """The fit check passed but the device ran out anyway (other processes, fragmentation):
    the numbers we had, and what to try."""
    if device.type == "cuda":
        torch.cuda.empty_cache()
    free = free_memory(device)
    shapes = checkpoint.shapes
    dtype_bytes = dtype.itemsize
    needed = estimate_weight_bytes(
        shapes, dtype_bytes, estimate_mode(settings, config), settings.double_quant, device.type
    )
    stronger = {"none": "--quant int8 or --quant int4, ", "int8": "--quant int4, "}.get(settings.quant, "")
    return MemoryShortage(
        f"out of memory loading {checkpoint.name} on {device}: its weights need about {format_bytes(needed)}"
        + (f" and {format_bytes(free)} is free now" if free is not None else ""),
        f"try {stronger}--offload, or free the device",
    )
