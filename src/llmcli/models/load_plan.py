"""What a load of a model would be, settled before any weight is read: its config, --quant made
concrete, the device, dtype and context (`plan_load`, for a load), and, without torch, the device,
dtype and weight bytes a plain `-m` would load with here (`settled_load`, for `models show`).

torch takes about a second to import; `models show` answers from the files and this module,
and imports torch only where the answer needs it (a GPU driver present, or a 16-bit GGUF on a
CPU whose half-precision support only torch reports)."""

from __future__ import annotations

import dataclasses
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from llmcli.config.settings import LoadSettings
from llmcli.errors import ModelLoadError
from llmcli.models.checkpoint import Checkpoint
from llmcli.models.memory import (
    FitRequest,
    context_length_of,
    fits,
    free_memory,
    kv_bytes_per_token,
    native_mode,
)
from llmcli.models.quant import auto_quant, check_quant_request, native_quant_kind

if TYPE_CHECKING:
    import torch

_ITEMSIZE = {"bf16": 2, "fp16": 2, "fp32": 4}
# Device nodes and driver files without which torch sees no GPU: NVIDIA's driver (also what a
# container with GPUs mounts), ROCm's kernel driver, WSL2's GPU paravirtualisation.
_GPU_SIGNS = ("/proc/driver/nvidia/version", "/dev/kfd", "/dev/dxg")


def plan_quantization(
    settings: LoadSettings, config: dict[str, Any], device_type: str, checkpoint: Checkpoint | None
) -> tuple[LoadSettings, str | None, int | None]:
    """The settings with --quant made concrete (auto resolved: never bitsandbytes), and, when
    llmcli quantizes with its own formats, the kind (int8 or int4) and int4's group size.
    `checkpoint`: None for random weights."""
    source = checkpoint.source if checkpoint is not None else "random"
    requested, group = auto_quant(settings.quant, source, checkpoint)
    native = native_quant_kind(requested, settings.engine, settings.offload, device_type, config)
    if settings.quant == "auto" and native is None:
        requested = "none"
    return dataclasses.replace(settings, quant=requested), native, group


@dataclass
class LoadPlan:
    """What a load settles before any weight is read, whichever builder then reads them."""

    config: dict[str, Any]
    settings: LoadSettings  # --quant made concrete
    device: torch.device
    dtype: torch.dtype
    native_quant: str | None  # int8 or int4 when llmcli's own kernels quantize
    group: int | None  # int4's group size
    context: int
    context_note: str | None


def plan_load(checkpoint: Checkpoint, settings: LoadSettings) -> LoadPlan:
    """The device, dtype, quantization and context of a load, from the checkpoint and the
    settings alone: nothing else is done here (no threads set, no library quieted), so both
    builders take the same plan, and a refusal here is the same whichever would have built."""
    from llmcli.models.device import choose_device, gguf_float_dtype

    config = checkpoint.config
    names: set[str] = set()
    for header in checkpoint.headers.values():  # a damaged file is named now, not crashed on later
        names |= set(header)
    _check_every_expert_stored(checkpoint.path, config, names)
    device = choose_device(settings.device)
    settings, native_quant, group = plan_quantization(settings, config, device.type, checkpoint)
    dtype = plan_dtype(settings, device, native_quant)
    keeps_file_width = settings.dtype == "auto" and native_quant is None and device.type == "cpu"
    if checkpoint.source == "gguf" and keeps_file_width:
        dtype = gguf_float_dtype(checkpoint.gguf_type, device) or dtype
    native = native_quant is not None
    check_quant_request(settings.quant, device.type, checkpoint.source, config, native=native)
    context, context_note = plan_context(
        checkpoint, settings, config, device, dtype, (native_quant, group) if native_quant else None
    )
    return LoadPlan(config, settings, device, dtype, native_quant, group, context, context_note)


def plan_dtype(settings: LoadSettings, device: torch.device, native_quant: str | None) -> torch.dtype:
    """The dtype to load in. Native int8/int4 kernels are fast with bf16 activations only, so
    such a model computes in bf16."""
    import torch

    from llmcli.models.device import choose_dtype

    dtype = choose_dtype(settings.dtype, device)
    return torch.bfloat16 if native_quant is not None and settings.dtype == "auto" else dtype


def estimate_mode(settings: LoadSettings, config: dict[str, Any]) -> str:
    """How to size the weights: as quantized on load, or, for a checkpoint that comes quantized,
    as they are stored (it loads as it is)."""
    return "stored" if config.get("quantization_config") else settings.quant


def plan_context(
    checkpoint: Checkpoint,
    settings: LoadSettings,
    config: dict[str, Any],
    device: torch.device,
    dtype: torch.dtype,
    native: tuple[str, int | None] | None = None,
) -> tuple[int, str | None]:
    """The context to use, checked against free memory before anything is loaded. `native`:
    (int8 or int4, its group) when llmcli quantizes with its own formats."""
    from llmcli.models.device import DTYPE_NAMES

    model_context = context_length_of(config)
    context = min(model_context, settings.context_length or model_context)
    limits = [
        b for b in (free_memory(device, offload=settings.offload), settings.max_memory) if b is not None
    ]
    budget = min(limits) if limits else None
    shapes = checkpoint.shapes
    if budget is None or not shapes:
        return context, None
    dtype_bytes = dtype.itemsize
    quant = native_mode(*native, shapes) if native else estimate_mode(settings, config)
    return fits(
        FitRequest(
            name=checkpoint.name,
            device=str(device),
            shapes=shapes,
            dtype_bytes=dtype_bytes,
            dtype_name=DTYPE_NAMES.get(dtype, str(dtype)),
            quant=quant,
            double_quant=settings.double_quant,
            weight_bytes=planned_weight_bytes(checkpoint, settings, quant, dtype_bytes, device.type),
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


def surely_cpu() -> bool:
    """Whether `--device auto` picks the CPU, known without torch: on Linux with no GPU driver,
    torch sees no GPU. Elsewhere (macOS's MPS, Windows) only torch can say."""
    return sys.platform.startswith("linux") and not any(Path(sign).exists() for sign in _GPU_SIGNS)


def _auto_device_and_dtype() -> tuple[str, str]:
    """--device auto and --dtype auto as a load here settles them: (device type, dtype name)."""
    if surely_cpu():
        return "cpu", "fp32"
    from llmcli.models.device import DTYPE_NAMES, choose_device, choose_dtype

    device = choose_device("auto")
    return device.type, DTYPE_NAMES[choose_dtype("auto", device)]


def default_load(folder: Path, source: str, quant: str = "auto") -> tuple[str, str, str, int]:
    """settled_load of the model in `folder`."""
    return settled_load(Checkpoint(folder.name, folder, source), quant)


def settled_load(checkpoint: Checkpoint, quant: str = "auto") -> tuple[str, str, str, int]:
    """How `-m` with `--quant quant` and no other flags would load this model here, without
    loading it: (device, dtype, quant label, estimated weight bytes) — the figures `models show`
    gives for this machine."""
    from llmcli.models.memory import native_mode

    config = checkpoint.config
    device_type, dtype = _auto_device_and_dtype()
    planned, native, group = plan_quantization(LoadSettings(quant=quant), config, device_type, checkpoint)
    if native:
        dtype = "bf16"
    elif checkpoint.source == "gguf":  # as plan_load settles it
        dtype = _gguf_float_dtype_name(checkpoint.gguf_type, device_type) or dtype
    shapes = checkpoint.shapes
    stored = (config.get("quantization_config") or {}).get("quant_method")
    if native:
        mode = native_mode(native, group, shapes)
    elif planned.quant in ("none", "auto"):
        mode = "stored" if stored else "none"
    else:  # bitsandbytes
        mode = planned.quant
    if native:
        label = mode.removeprefix("native-")
    else:
        label = (stored or "none") if mode in ("none", "stored") else mode
    blocks = block_types(checkpoint, quant, device_type) if native else frozenset()
    weight_bytes = planned_weight_bytes(
        checkpoint, LoadSettings(quant=quant), mode, _ITEMSIZE[dtype], device_type
    )
    return device_type, dtype, _blocks_label(shapes, blocks, label), weight_bytes


def planned_weight_bytes(
    checkpoint: Checkpoint, settings: LoadSettings, mode: str, dtype_bytes: int, device_type: str
) -> int:
    """The weights' bytes once loaded, as `mode` (estimate_weight_bytes's) holds them on
    `device_type`, a GGUF file's layers of the types block_types names at their blocks' own size:
    the one estimate that the fit check before a load and `models show` both give."""
    from llmcli.models.memory import estimate_weight_bytes

    blocks = (
        block_types(checkpoint, settings.quant, device_type) if mode.startswith("native-") else frozenset()
    )
    return estimate_weight_bytes(
        checkpoint.shapes, dtype_bytes, mode, settings.double_quant, device_type, block_types=blocks
    )


def _blocks_label(shapes: dict[str, Any], blocks: frozenset[str], label: str) -> str:
    """quantize_model's label where the file's blocks are kept: all its linear layers (the head,
    or the table tied to it, included), or some beside llmcli's own int8/int4."""
    types = _linear_types(shapes)
    if not any(name.endswith("lm_head.weight") for name in shapes):  # tied: the table is the head
        types |= {tensor.gguf_type for name, tensor in shapes.items() if name.endswith("embed_tokens.weight")}
    if not types & blocks:
        return label
    return "gguf-blocks" if types <= blocks else f"gguf-blocks+{label}"


def _linear_types(shapes: dict[str, Any]) -> set[str | None]:
    """The GGUF types of a checkpoint's linear layers (None: a layer not from a GGUF file)."""
    from llmcli.models.memory import is_native_linear

    return {tensor.gguf_type for name, tensor in shapes.items() if is_native_linear(name, tensor.shape)}


def block_types(checkpoint: Checkpoint, quant: str, device_type: str) -> frozenset[str]:
    """The GGUF types a load of `checkpoint` keeps in the file's own blocks (load.py's
    _block_kernels), for a file read in place under --quant auto: on a GPU, every type gguf_cuda's
    Triton kernels decode (each layer in its own type, the others int8 or int4 as before); on a
    CPU, those of llmcli's compiled kernels where cpu_kernels.takes_file says they take the file."""
    if checkpoint.source != "gguf" or quant != "auto" or not checkpoint.read_in_place:
        return frozenset()
    if device_type == "cuda":
        from llmcli.models import gguf_cuda

        return gguf_cuda.TYPES if gguf_cuda.available() else frozenset()
    if device_type != "cpu":
        return frozenset()
    from llmcli.models.cpu_kernels import kernels, takes_file

    loaded = kernels()
    if loaded is None or not takes_file(frozenset(t for t in _linear_types(checkpoint.shapes) if t)):
        return frozenset()
    return loaded.types


def _gguf_float_dtype_name(type_name: str | None, device_type: str) -> str | None:
    """A 16-bit GGUF's own width where the load keeps it (device.gguf_float_dtype); torch is asked
    about the CPU only for such a file."""
    if device_type != "cpu" or type_name not in ("F16", "BF16"):
        return None
    import torch

    from llmcli.models.device import DTYPE_NAMES, gguf_float_dtype

    kept = gguf_float_dtype(type_name, torch.device("cpu"))
    return DTYPE_NAMES[kept] if kept is not None else None
