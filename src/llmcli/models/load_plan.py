"""What a load of a model would be, settled without torch: its config, --quant made concrete,
and (for `models show`) the device, dtype and weight bytes a plain `-m` would load with here.

torch takes about a second to import; `models show` answers from the files and this module,
and imports torch only where the answer needs it (a GPU driver present, or a 16-bit GGUF on a
CPU whose half-precision support only torch reports)."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Any

from llmcli.config.settings import LoadSettings
from llmcli.models.checkpoint import Checkpoint
from llmcli.models.quant import auto_quant, native_quant_kind

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
    from llmcli.models.memory import estimate_weight_bytes, native_mode

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
    weight_bytes = estimate_weight_bytes(shapes, _ITEMSIZE[dtype], mode, device_type=device_type)
    return device_type, dtype, label, weight_bytes


def _gguf_float_dtype_name(type_name: str | None, device_type: str) -> str | None:
    """A 16-bit GGUF's own width where the load keeps it (device.gguf_float_dtype); torch is asked
    about the CPU only for such a file."""
    if device_type != "cpu" or type_name not in ("F16", "BF16"):
        return None
    import torch

    from llmcli.models.device import DTYPE_NAMES, gguf_float_dtype

    kept = gguf_float_dtype(type_name, torch.device("cpu"))
    return DTYPE_NAMES[kept] if kept is not None else None
