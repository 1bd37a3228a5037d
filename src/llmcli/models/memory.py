"""Memory: what the weights really take once loaded, what a model will need before it is loaded,
and whether that fits in what the device has free.

The estimate reads the safetensors headers (names, shapes; no weights) and the config, so the
answer comes before a single byte is loaded. Quantized sizes follow bitsandbytes' formats:
INT8 keeps one byte per weight plus an fp32 scale per output row; NF4/FP4 keep half a byte per
weight plus an absmax per block of 64 (fp32, or 8-bit with double quantization) and a small
codebook per layer. Embeddings,
norms and the output head stay in the compute dtype.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llmcli.errors import MemoryShortage
from llmcli.models.headers import TensorHeader

_UNQUANTIZED_NAME_PARTS = ("embed", "lm_head", "wte", "wpe", "norm", "ln_")
_INT4_BLOCK = 64
_INT4_CODEBOOK = 16 * 4 + 4  # the 16 NF4/FP4 levels in fp32, and an offset
_NESTED_CODEBOOK = 256 * 4  # double quantization's 8-bit codebook in fp32
# Below this many tokens of context a model is not worth loading: suggest something else instead.
MIN_USEFUL_CONTEXT = 2048
# Keep this share of free memory for activations, allocator slack and the CUDA context.
_HEADROOM = 0.10


def format_bytes(count: float) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if count >= size:
            return f"{count / size:.1f} {unit}"
    return f"{count:.0f} B"


def context_length_of(config: dict[str, Any]) -> int:
    text = config.get("text_config") or config
    for name in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = text.get(name)
        if isinstance(value, int) and value > 0:
            return value
    return 2048


# Measured ----------------------------------------------------------------------------------------


def measured_weight_bytes(model: Any) -> int:
    """Bytes of every tensor the weights occupy in memory, each counted once: parameters and
    buffers, plus bitsandbytes' side tensors (INT8 row scales, 4-bit absmax and codebooks),
    which are not parameters and which `get_memory_footprint` misses or miscounts."""
    seen: set[int] = set()
    total = 0
    for tensor in _weight_tensors(model):
        if tensor.device.type == "meta" or tensor.data_ptr() in seen:
            continue
        seen.add(tensor.data_ptr())
        total += tensor.numel() * tensor.element_size()
    return total


def _weight_tensors(model: Any) -> Iterator[Any]:
    import torch

    for parameter in model.parameters():
        yield parameter
        scale = getattr(parameter, "SCB", None)
        if isinstance(scale, torch.Tensor):
            yield scale
        state = getattr(parameter, "quant_state", None)
        while state is not None:
            for name in ("absmax", "code", "offset"):
                value = getattr(state, name, None)
                if isinstance(value, torch.Tensor):
                    yield value
            state = getattr(state, "state2", None)
    yield from model.buffers()


def kv_bytes_per_token(config: dict[str, Any], dtype_bytes: int) -> int:
    """Keys and values of one token in every layer that keeps them: layers × KV heads × head dim ×
    2 × dtype bytes. A linear-attention layer (Qwen3.5's) keeps a state of a fixed size instead;
    Gemma 4's layers differ in width, and those reading another's keep none."""
    per_layer = _per_layer_kv_bytes_per_token(config, dtype_bytes)
    if per_layer is not None:
        return per_layer
    text = config.get("text_config") or config
    layers = text.get("num_hidden_layers") or text.get("n_layer") or 0
    kinds = text.get("layer_types")
    if isinstance(kinds, list) and kinds:
        layers = sum(kind != "linear_attention" for kind in kinds)
    heads = text.get("num_attention_heads") or text.get("n_head") or 1
    kv_heads = text.get("num_key_value_heads") or heads
    head_dim = text.get("head_dim") or (text.get("hidden_size") or text.get("n_embd") or 0) // heads
    return layers * kv_heads * head_dim * 2 * dtype_bytes


def _per_layer_kv_bytes_per_token(config: dict[str, Any], dtype_bytes: int) -> int | None:
    """A family whose layers differ, from its layer kinds as the native loader settles them
    (lean_config.py: a config.json may leave them to its class's defaults): Qwen3.5's full
    layers alone (every `full_attention_interval`th by default), or each Gemma 4 layer that
    computes keys and values at its own width (gemma4_layout). None for any other family."""
    from llmcli.models.families import family

    architectures = config.get("architectures") or [None]
    row = family(architectures[0])
    if row is None or row.layer_types not in ("linear", "gemma4"):
        return None
    from llmcli.models.gemma4_layout import kv_sources, layer_shapes
    from llmcli.models.lean_config import LeanConfig

    lean = LeanConfig(config)
    if row.layer_types == "linear":
        full = sum(kind != "linear_attention" for kind in lean.layer_types)
        return full * lean.num_key_value_heads * lean.head_dim * 2 * dtype_bytes
    sources = kv_sources(lean)
    shapes = layer_shapes(lean)
    return sum(
        2 * kv_heads * head_dim * dtype_bytes
        for i, (head_dim, kv_heads) in enumerate(shapes)
        if sources[i] == i
    )


# Estimated -----------------------------------------------------------------------------------------


def weight_shapes(folder: Path) -> dict[str, TensorHeader]:
    """Tensor name → shape and stored element size, from the headers of every *.safetensors file,
    or of the GGUF file a folder reads in place (gguf_direct.py; its blocks counted as 2 bytes a
    weight, the 16-bit width they are estimated against). No weights are read."""
    from llmcli.models.checkpoint import Checkpoint

    return Checkpoint(folder.name, folder, "folder").shapes


def is_quantized_by_bitsandbytes(name: str, shape: list[int]) -> bool:
    """Linear layers' weights: 2-D, and not embeddings, norms or the output head."""
    return (
        name.endswith(".weight") and len(shape) == 2 and not any(p in name for p in _UNQUANTIZED_NAME_PARTS)
    )


def native_mode(kind: str, group: int | None, tensors: dict[str, TensorHeader]) -> str:
    """The estimate mode of llmcli's own quantization: native-int8, or native-int4-gN."""
    if kind == "int8":
        return "native-int8"
    from llmcli.models.quant import pick_int4_group

    # The group is the linear layers'; an expert whose width it does not divide goes to int8.
    widths = {
        t.shape[1]
        for name, t in tensors.items()
        if is_native_linear(name, t.shape) and ".experts." not in name
    }
    return f"native-int4-g{group or pick_int4_group(widths)}"


def is_native_linear(name: str, shape: list[int]) -> bool:
    return len(shape) == 2 and (name.endswith("_proj.weight") or name.endswith("lm_head.weight"))


def _native_bytes(
    tensors: dict[str, TensorHeader],
    dtype_bytes: int,
    mode: str,
    device_type: str,
    block_types: frozenset[str] = frozenset(),
) -> float:
    """llmcli's int8 (a byte per weight and a scale per row) and int4 (half a byte per weight and
    a scale and a zero per group) for the linear layers; the output head int8, and its own copy
    when it was tied to the embedding; everything else in the load dtype. A GGUF file read in
    place holds its own types: its 4-bit blocks int4 (the head's too), its other quantized
    matrices int8, and on a CPU a quantized embedding in its blocks, or, tied to an int8 head,
    read from the head (gguf_direct.py, gguf_embedding.py). `block_types`: the GGUF types llmcli's
    compiled kernels multiply in the file's own blocks (block_linear.py), held at the file's size;
    a tied table then reads its rows from the head's blocks."""
    group = int(mode.rpartition("-g")[2]) if "int4" in mode else 0

    def held_as_int4(tensor: TensorHeader, is_head: bool) -> bool:
        coded = tensor.gguf_type in _GGUF_INT4_TYPES  # the file's own 4-bit codes, even the head's
        quantized_here = tensor.gguf_type in _FLOATS and not is_head
        fits = group and tensor.shape[1] % group == 0 and _int4_packs(tensor.shape, device_type)
        return bool(fits) and (coded or quantized_here)

    def linear_bytes(tensor: TensorHeader, is_head: bool) -> float:
        if tensor.gguf_type in block_types:
            return tensor.gguf_bytes
        if held_as_int4(tensor, is_head):
            return tensor.count / 2 + tensor.count / group * 2 * dtype_bytes
        return tensor.count + tensor.shape[0] * dtype_bytes

    total = 0.0
    for name, tensor in tensors.items():
        if is_native_linear(name, tensor.shape):
            total += linear_bytes(tensor, name.endswith("lm_head.weight"))
        elif (
            name.endswith("embed_tokens.weight") and device_type == "cpu" and tensor.gguf_type not in _FLOATS
        ):
            total += tensor.gguf_bytes  # kept in the file's blocks
        else:
            total += tensor.count * dtype_bytes
    if not any(name.endswith("lm_head.weight") for name in tensors):
        embedding = next((t for name, t in tensors.items() if name.endswith("embed_tokens.weight")), None)
        if embedding is not None:  # tied: the head becomes a matrix of its own
            total += linear_bytes(embedding, True)
            packed = device_type == "cpu" and embedding.gguf_type not in _FLOATS
            if packed and (embedding.gguf_type in block_types or not held_as_int4(embedding, True)):
                total -= embedding.gguf_bytes  # an int8 head or the blocks: the table is read from it
    return total


def _int4_packs(shape: list[int], device_type: str) -> bool:
    """Whether torch's int4 kernel packs this matrix (quantized.py's _tinygemm_fits): a CPU packs
    rows by 16, CUDA tiles the input by 128 and the output by 8; other shapes go to int8."""
    rows, columns = shape
    return rows % 8 == 0 and columns % 128 == 0 if device_type == "cuda" else rows % 16 == 0


_GGUF_INT4_TYPES = frozenset({"Q4_0", "Q4_1", "Q4_K"})  # read as int4 codes (gguf_direct.py)
_FLOATS = frozenset({None, "F32", "F16", "BF16"})


def estimate_weight_bytes(
    tensors: dict[str, TensorHeader],
    dtype_bytes: int,
    quant: str,
    double_quant: bool = True,
    device_type: str = "cpu",
    block_types: frozenset[str] = frozenset(),
) -> int:
    """Bytes the weights will take once loaded. `quant` "stored" means as they are in the files
    (a checkpoint that comes quantized loads as it is); "native-…" llmcli's own formats (see
    native_mode, with the file's `block_types` held as blocks); int8/int4 bitsandbytes'."""
    if quant.startswith("native-"):
        return int(_native_bytes(tensors, dtype_bytes, quant, device_type, block_types))
    total = 0.0
    for name, tensor in tensors.items():
        count = tensor.count
        if quant == "stored":
            total += count * tensor.itemsize
        elif quant == "none" or not is_quantized_by_bitsandbytes(name, tensor.shape):
            total += count * dtype_bytes
        elif quant == "int8":
            total += count + tensor.shape[0] * 4
        else:
            blocks = count / _INT4_BLOCK
            total += count / 2 + _INT4_CODEBOOK
            # Block scales: fp32, or 8-bit plus a second level (its own codebook, an fp32 per 256).
            total += blocks + _NESTED_CODEBOOK + blocks / 256 * 4 if double_quant else blocks * 4
    return int(total)


# Fit ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class FitRequest:
    name: str
    device: str
    shapes: dict[str, TensorHeader]
    dtype_bytes: int
    dtype_name: str
    quant: str
    double_quant: bool
    weight_bytes: int  # the weights' estimate (load_plan.planned_weight_bytes): models show's too
    kv_per_token: int
    context: int  # the context wanted: --ctx, else the model's
    context_given: bool  # the user asked for this context explicitly
    budget: int  # bytes llmcli may use on the device


def fits(request: FitRequest) -> tuple[int, str | None]:
    """The context to use, and a note when it had to be lowered to fit. Raises when nothing fits.

    A context the user did not ask for is lowered to what fits; one they asked for is not.
    """
    budget = int(request.budget * (1 - _HEADROOM))
    weights = request.weight_bytes
    kv = request.kv_per_token * request.context
    if weights + kv <= budget:
        return request.context, None
    room = (budget - weights) // request.kv_per_token if request.kv_per_token else 0
    fitting_context = int(room // 256 * 256)
    lowest = min(MIN_USEFUL_CONTEXT, request.context)
    if fitting_context >= lowest and not request.context_given:
        return fitting_context, (
            f"Context limited to {fitting_context} tokens (of {request.context}) so the KV cache fits "
            f"in the {format_bytes(request.budget)} available on {request.device}; --ctx to choose."
        )
    label = {"none": request.dtype_name, "stored": "as stored"}.get(request.quant, request.quant)
    problem = (
        f"{request.name} needs {format_bytes(weights)} of weights ({label}) + {format_bytes(kv)} of KV "
        f"cache for {request.context} tokens, but only {format_bytes(request.budget)} is available on "
        f"{request.device}"
    )
    raise MemoryShortage(problem, f"try {nearest_fitting_option(request, budget, fitting_context, lowest)}")


def nearest_fitting_option(request: FitRequest, budget: int, fitting_context: int, lowest: int) -> str:
    if fitting_context >= lowest:
        return f"--ctx {fitting_context}"
    order = {"none": ("int8", "int4"), "int8": ("int4",)}.get(request.quant, ())
    for quant in order:
        weights = estimate_weight_bytes(request.shapes, request.dtype_bytes, quant, request.double_quant)
        needed = weights + request.kv_per_token * request.context
        if needed <= budget:
            return f"--quant {quant} ({format_bytes(needed)} with the KV cache)"
        if weights + request.kv_per_token * lowest <= budget:
            context = int((budget - weights) // request.kv_per_token // 256 * 256)
            return f"--quant {quant} --ctx {context}"
    if request.device.startswith("cuda"):
        return "--offload, to keep what does not fit in CPU memory (slower)"
    return "a smaller model"


def free_memory(device: Any, offload: bool = False) -> int | None:
    """Bytes free where the model will live (all visible GPUs for device "cuda"), or None if unknown."""
    import torch

    if device.type == "cuda":
        indices = [device.index] if device.index is not None else range(torch.cuda.device_count())
        free = sum(torch.cuda.mem_get_info(i)[0] for i in indices)
        return free + (available_host_memory() or 0) if offload else free
    if device.type == "cpu":
        return available_host_memory()
    return None


def available_host_memory() -> int | None:
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None
