"""Weight-only quantized linear layers that decode faster: they read fewer bytes per token.

- int8: one scale per output channel, w ≈ q · scale with q in [-127, 127].
- int4: groups of `group` weights along the input, each with a float scale and zero point,
  w ≈ (q − 8) · scale + zero with q in [0, 15] (the convention of torch's tinygemm kernels).

They run on torch's own kernels for these formats where torch has them:
`_weight_int4pack_mm_for_cpu` and `_weight_int8pack_mm` on a CPU. int4 on CUDA runs a Triton
kernel of llmcli's own (`int4_cuda.py`: a speculative check's rows read the codes once, where
tinygemm's cost grew with them; LLMCLI_INT4_CUDA=tinygemm keeps torch's); int8 on CUDA runs
a small Triton GEMV of llmcli's own (`int8_cuda.py`), since torch has none there. Measured on this project's
2-core CPU (avx512_bf16): those kernels are fast only with bf16 activations (a 3072×576 layer:
fp32 dense 0.64 ms, int8 0.29 ms and int4 0.23 ms with bf16 inputs, but 2.3 and 4.0 ms with fp32
inputs), so models quantized this way compute in bf16. `QuantizedLinear` is an nn.Module with an
ordinary forward: transformers' own model code runs it too, which is how it is tested.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Protocol

import torch
import torch.nn.functional as F

from llmcli.models import int4_cuda
from llmcli.models.block_linear import BlockKernels, BlockLinear
from llmcli.models.gguf_int4 import dequantize as dequantize_codes
from llmcli.models.quant import pick_int4_group

CUDA_INNER_K_TILES = 8
# int8 quantizes a matrix in slices of about this many weights: each slice's fp32 copy and its
# temporaries (4 MB each) are the quantizer's whole passing cost, for any width of row.
_ELEMENTS_AT_A_TIME = 1 << 20


class QuantizedLinear(torch.nn.Module):
    def __init__(
        self,
        kind: str,
        packed: torch.Tensor,
        scales: torch.Tensor,
        bias: torch.Tensor | None,
        shape: tuple[int, int],
        group: int = 0,
    ) -> None:
        super().__init__()
        self.kind = kind  # "int8" or "int4"
        self.group = group
        self.out_features, self.in_features = shape
        self.register_buffer("packed", packed)
        self.register_buffer("scales", scales)
        self.register_buffer("bias", bias)
        self._matmul = _kernel(kind, packed.device, self.in_features, packed.dtype)
        self._rows_in_out = bias is None  # rows in, the kernel's rows out: nothing to reshape or add

    @property
    def label(self) -> str:
        return f"int4-g{self.group}" if self.kind == "int4" else "int8"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._rows_in_out and x.dim() == 2:
            return self._matmul(x, self)  # a decode step's shape: a CPU step is ~120 of these calls
        shape = x.shape
        out = self._matmul(x.reshape(-1, shape[-1]), self)
        out = out.reshape(*shape[:-1], self.out_features)
        return out + self.bias if self.bias is not None else out

    @classmethod
    def int8(cls, weight: torch.Tensor, bias: torch.Tensor | None) -> QuantizedLinear:
        _refuse_stand_in(weight)
        rows_of = weight.detach().__getitem__
        codes, scales = int8_codes(rows_of, tuple(weight.shape), weight.device, weight.dtype)
        return cls.from_int8(codes, scales, bias, weight.dtype)

    @classmethod
    def from_int8(
        cls, codes: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype
    ) -> QuantizedLinear:
        """int8 from codes [N, K] in -127…127 and per-channel scales [N] (int8_codes)."""
        return cls("int8", codes, scales.to(dtype), _bias(bias), tuple(codes.shape))

    @classmethod
    def int4(cls, weight: torch.Tensor, bias: torch.Tensor | None, group: int) -> QuantizedLinear:
        _refuse_stand_in(weight)
        out_features, in_features = weight.shape
        w = weight.detach().float().view(out_features, in_features // group, group)
        low, high = w.amin(dim=-1), w.amax(dim=-1)
        scales = ((high - low) / 15).clamp(min=1e-6)
        q = ((w - low[..., None]) / scales[..., None]).round().clamp(0, 15).to(torch.int32)
        zeros = low + 8 * scales
        return cls.from_codes(q.view(out_features, in_features), scales, zeros, bias, group, weight.dtype)

    @classmethod
    def from_codes(
        cls,
        codes: torch.Tensor,
        scales: torch.Tensor,
        zeros: torch.Tensor,
        bias: torch.Tensor | None,
        group: int,
        dtype: torch.dtype,
    ) -> QuantizedLinear:
        """int4 from codes [N, K] in 0…15 and per-group scales and zeros [N, K / group], where
        w = (code − 8) · scale + zero. (A GGUF Q4_0/Q4_1 block maps onto this exactly.)"""
        device = codes.device
        # [K / group, N, 2]: the layout both tinygemm kernels read, and int4_cuda's.
        scales_and_zeros = torch.stack([scales, zeros], dim=-1).transpose(0, 1).contiguous().to(dtype)
        kernel = int4_cuda.chosen_kernel()  # read on every device: a bad name is refused anywhere
        if device.type == "cuda" and kernel == "triton":
            packed = int4_cuda.pack(codes)  # bytes [N, K / 2]: llmcli's kernel, one read for all rows
        elif device.type == "cuda":
            pairs = (codes[:, ::2] << 4 | codes[:, 1::2]).to(torch.uint8)
            packed = torch.ops.aten._convert_weight_to_int4pack(pairs, CUDA_INNER_K_TILES)
        else:
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), 1)
        return cls("int4", packed, scales_and_zeros, _bias(bias), tuple(codes.shape), group)

    def dequantized(self) -> torch.Tensor:
        """The weights these codes stand for, [out, in] in fp32: the reference in tests."""
        eye = torch.eye(self.in_features, dtype=self.scales.dtype, device=self.packed.device)
        bias, self.bias = self.bias, None
        try:
            return self.forward(eye).float().t().contiguous()
        finally:
            self.bias = bias


def int8_codes(
    rows_of: Callable[[slice], torch.Tensor],
    shape: tuple[int, int],
    device: torch.device,
    scale_dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel int8 codes and scales (in `scale_dtype`, as the kernel reads them) of a matrix
    of `shape` whose rows `rows_of` gives, a slice at a time: an fp32 copy of a whole output head
    would be the load's peak, and a GGUF file's blocks are dequantized slice by slice this way,
    never whole. The codes are chosen for the scale as stored: rounding a bf16 scale after the
    codes were chosen for the fp32 one scaled each row by up to 0.4 % (the demo's Q5_0 file:
    perplexity 24.09 against 23.93, the exact reader's 23.74)."""
    codes = torch.empty(shape, dtype=torch.int8, device=device)
    scales = torch.empty(shape[0], dtype=torch.float32, device=device)
    step = max(1, _ELEMENTS_AT_A_TIME // shape[1])
    # At least the smallest normal value of the stored type: an all-zero row stays zero, not NaN.
    smallest = torch.finfo(scale_dtype).tiny
    for start in range(0, shape[0], step):
        rows = slice(start, start + step)
        w = rows_of(rows).to(device=device, dtype=torch.float32)
        scales[rows] = (w.abs().amax(dim=1) / 127).clamp(min=smallest).to(scale_dtype).float()
        codes[rows] = (w / scales[rows, None]).round().clamp(-127, 127).to(torch.int8)
    return codes, scales.to(scale_dtype)


def _refuse_stand_in(weight: torch.Tensor) -> None:
    """A lean load's stand-in (models/lean_model.py) is a promise that the file's own codes
    replace the layer: quantizing it instead would give a layer of zeros."""
    from llmcli.models.tensor_file import is_stand_in

    if is_stand_in(weight):
        raise RuntimeError("the quantizer met a layer the loader never read (a bug in llmcli's lean loader)")


def _bias(bias: torch.Tensor | None) -> torch.Tensor | None:
    return None if bias is None else bias.detach().clone()


# torch's own bindings of the CPU kernels: 1.7 µs a call less than through torch.ops.
_INT8_MM = getattr(torch, "_weight_int8pack_mm", torch.ops.aten._weight_int8pack_mm)
_INT4_MM_CPU = getattr(torch, "_weight_int4pack_mm_for_cpu", torch.ops.aten._weight_int4pack_mm_for_cpu)


def _in_dtype(scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return scales if scales.dtype == dtype else scales.to(dtype)


def _int8_mm(x: torch.Tensor, layer: QuantizedLinear) -> torch.Tensor:
    return _INT8_MM(x, layer.packed, _in_dtype(layer.scales, x.dtype))


def _int8_mm_cuda(x: torch.Tensor, layer: QuantizedLinear) -> torch.Tensor:
    from llmcli.models.int8_cuda import int8_matmul

    return int8_matmul(x, layer.packed, layer.scales)


def _int8_dequantizing_mm(x: torch.Tensor, layer: QuantizedLinear) -> torch.Tensor:
    """Where torch has no int8 kernel for the device: correct, not fast."""
    return F.linear(x, layer.packed.to(x.dtype)) * layer.scales.to(x.dtype)


def _int4_mm_cpu(x: torch.Tensor, layer: QuantizedLinear) -> torch.Tensor:
    return _INT4_MM_CPU(x, layer.packed, layer.group, _in_dtype(layer.scales, x.dtype))


def _int4_mm_cuda(x: torch.Tensor, layer: QuantizedLinear) -> torch.Tensor:
    return torch.ops.aten._weight_int4pack_mm(x, layer.packed, layer.group, layer.scales.to(x.dtype))


def _int4_mm_triton(x: torch.Tensor, layer: QuantizedLinear) -> torch.Tensor:
    return int4_cuda.int4_matmul(x, layer.packed, layer.scales, layer.group)


# torch's CPU int8 kernel reads its input in blocks of this many columns: on a narrower
# remainder with 4 rows or more it crashes the process (a segfault: torch 2.x, bf16, 8 or 24
# columns, measured), where a Gemma 4 tiny model's per-layer input is 8 wide.
INT8_KERNEL_COLUMNS = 16


def _kernel(
    kind: str, device: torch.device, in_features: int, packed_dtype: torch.dtype
) -> Callable[[torch.Tensor, QuantizedLinear], torch.Tensor]:
    if kind == "int4" and device.type == "cuda":
        # Bytes: llmcli's own packing (int4_cuda.py); tinygemm's is int32.
        return _int4_mm_triton if packed_dtype == torch.uint8 else _int4_mm_cuda
    if kind == "int4":
        return _int4_mm_cpu
    if device.type == "cuda":
        return _int8_mm_cuda  # torch has no CUDA int8 kernel: llmcli's own Triton GEMV
    if in_features % INT8_KERNEL_COLUMNS:
        return _int8_dequantizing_mm
    return _int8_mm if _has_int8_kernel(device.type) else _int8_dequantizing_mm


@functools.cache
def _has_int8_kernel(device_type: str) -> bool:
    device = torch.device(device_type)
    try:
        x = torch.zeros(1, 32, dtype=torch.bfloat16, device=device)
        w = torch.zeros(8, 32, dtype=torch.int8, device=device)
        torch.ops.aten._weight_int8pack_mm(x, w, torch.ones(8, dtype=torch.bfloat16, device=device))
    except (RuntimeError, NotImplementedError):
        return False
    return True


def int4_group(model: torch.nn.Module) -> int:
    return pick_int4_group({m.in_features for m in quantizable_linears(model).values()})


def quantizable_linears(model: torch.nn.Module) -> dict[str, torch.nn.Linear]:
    """The decoder's linear layers and the output head (the embedding stays as it is)."""
    return {name: m for name, m in model.named_modules() if type(m) is torch.nn.Linear}


# Linears that always run on the same input, quantized as one matrix: one kernel launch
# instead of two or three (at batch 1 on a GPU the small k and v products cost launch time,
# not bandwidth). Per-row int8 scales and int4 groups along the input make this exact: the
# codes of the whole are the codes of the parts, stacked.
FUSED_PROJECTIONS = (
    ("q_proj", "k_proj", "v_proj"),
    ("gate_proj", "up_proj"),
    ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"),  # a Gated DeltaNet's (Qwen3.5)
    ("in_proj_qkvz", "in_proj_ba"),  # Qwen3-Next's
)


class QuantizedSlice(torch.nn.Module):
    """One of several linears quantized as one matrix, as transformers' module code calls it:
    the whole product, then this part's outputs. (The native engine calls the whole once.)"""

    def __init__(self, whole: QuantizedLinear, start: int, end: int) -> None:
        super().__init__()
        self._whole = (whole,)  # a tuple, not a submodule: the buffers belong to the parent once
        self.start, self.end = start, end
        self.in_features, self.out_features = whole.in_features, end - start

    @property
    def whole(self) -> QuantizedLinear:
        return self._whole[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.whole(x)[..., self.start : self.end]


def quantize_model(
    model: torch.nn.Module,
    kind: str,
    group: int | None = None,
    exact: ExactCodes | None = None,
    kernels: BlockKernels | None = None,
) -> str:
    """Replace every linear layer with its quantized form, in place, one layer at a time (so the
    peak is the model plus one layer). q/k/v and gate/up become one matrix each (see
    FUSED_PROJECTIONS). The output head goes to int8 (it is the largest single matrix, and the
    one the next token's choice is most sensitive to) unless `exact` holds its own codes.
    `group`: int4's group size (default: the largest preferred one that fits). `exact`: int4
    codes to use as they are, by module name, instead of quantizing the weights (a GGUF file's
    4-bit blocks), and the layers int8 holds even when `kind` is int4 (`exact.wider`: a GGUF
    file's layers of more than 4 bits; their fused siblings are not fused with them).
    `kernels`: llmcli's compiled CPU kernels (or, on a GPU, gguf_cuda's), which multiply a GGUF
    file's layers in their own blocks (block_linear.py) wherever they have the layer's type; the
    other layers as above.
    `kind` "blocks": a model of fp16 or bf16 weights (a 16-bit GGUF file's) keeps them, each
    linear layer multiplied by the kernels on its own bytes (stacked experts stay as they are).
    Returns the label."""
    from llmcli.models.tensor_file import is_stand_in

    if kind == "int4" and group is None:
        group = int4_group(model)
    group = group or 0
    head = model.get_output_embeddings()
    wider = exact.wider if exact is not None else frozenset()
    device = next(model.parameters()).device  # where the exact codes go
    kinds = set()

    def quantized(
        names: list[str], weight: torch.Tensor, bias: torch.Tensor | None, is_head: bool
    ) -> QuantizedLinear:
        if kind == "blocks":  # a 16-bit model's own weights are the kernels' F16/BF16 rows
            return _counted(BlockLinear.of_weight(kernels, weight, bias))
        if kernels is not None and exact is not None:
            kept = _file_blocks(kernels, exact, names, weight, bias)
            if kept is not None:
                return _counted(kept)
        coded = exact is not None and group == exact.group and all(name in exact for name in names)

        def file_codes() -> tuple[torch.Tensor, ...]:  # codes, scales, zeros of `names`, stacked
            parts = [exact.get(name) for name in names]
            return tuple(torch.cat(part).to(device) for part in zip(*parts, strict=True))

        if coded and kind == "int4" and _tinygemm_fits(weight):  # the file's own codes, the head's too
            codes, scales, zeros = file_codes()
            return _counted(QuantizedLinear.from_codes(codes, scales, zeros, bias, group, weight.dtype))
        if kind == "int8" or is_head or not _tinygemm_fits(weight) or any(name in wider for name in names):
            read = [exact.int8(name, weight.dtype) for name in names] if exact is not None else [None]
            if all(part is not None for part in read):  # from the file's blocks, slice by slice
                codes, scales = (torch.cat(part).to(device) for part in zip(*read, strict=True))
                return _counted(QuantizedLinear.from_int8(codes, scales, bias, weight.dtype))
            if coded:  # the weights the codes stand for (the layer's weight is a stand-in)
                weight = dequantize_codes(*file_codes()).to(weight.dtype)
            return _counted(QuantizedLinear.int8(weight, bias))
        return _counted(QuantizedLinear.int4(weight, bias, group))

    def _counted(layer: QuantizedLinear | BlockLinear) -> QuantizedLinear | BlockLinear:
        kinds.add(layer.kind)
        return layer

    for module_name, module in list(model.named_modules()):
        for names in FUSED_PROJECTIONS:
            parts = [getattr(module, name, None) for name in names]
            if not all(type(part) is torch.nn.Linear for part in parts):
                continue
            if len({part.in_features for part in parts}) != 1:
                continue
            if len({f"{module_name}.{name}" in wider for name in names}) > 1:
                continue  # int4 and int8 parts: each quantized as it is, run in turn
            in_blocks = kernels is not None and exact is not None
            if in_blocks and len({exact.block_type(f"{module_name}.{name}") for name in names}) > 1:
                continue  # blocks of several types (Q4_K beside Q6_K): each its own
            if len({is_stand_in(part.weight) for part in parts}) > 1:
                continue  # parts read from the file's blocks beside parts read as floats
            weight = torch.cat([part.weight.detach() for part in parts])
            bias = None
            if any(part.bias is not None for part in parts):
                bias = torch.cat(
                    [
                        part.bias.detach() if part.bias is not None else weight.new_zeros(part.out_features)
                        for part in parts
                    ]
                )
            whole = quantized([f"{module_name}.{name}" for name in names], weight, bias, is_head=False)
            del weight
            setattr(module, "_llmcli_" + "_".join(names), whole)
            start = 0
            for name, part in zip(names, parts, strict=True):
                setattr(module, name, QuantizedSlice(whole, start, start + part.out_features))
                start += part.out_features
    for name, linear in quantizable_linears(model).items():
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, quantized([name], linear.weight, linear.bias, is_head=linear is head))
    for experts in stacked_experts(model) if kind != "blocks" else ():
        kinds |= quantize_experts(experts, kind, group)
    if getattr(model.config, "tie_word_embeddings", False):
        model.config.tie_word_embeddings = False  # the head is its own (int8) matrix now
    # What the layers became: on CUDA, widths the int4 kernel cannot tile stay int8.
    label = f"int4-g{group}" if "int4" in kinds else "int8"
    if "blocks" in kinds:  # the file's own blocks, and what the kernels have no type for
        return "gguf-blocks" if kinds == {"blocks"} else f"gguf-blocks+{label}"
    return label


def _file_blocks(
    kernels: BlockKernels,
    exact: ExactCodes,
    names: list[str],
    weight: torch.Tensor,
    bias: torch.Tensor | None,
) -> BlockLinear | None:
    """`names` (one layer, or parts fused into one) as the file's blocks, where all are stored
    in one type the compiled kernels multiply; None otherwise."""
    types = {exact.block_type(name) for name in names}
    type_name = types.pop() if len(types) == 1 else None
    if type_name is None or type_name not in kernels.types:
        return None
    parts = [exact.blocks(name) for name in names]
    blocks = (parts[0] if len(parts) == 1 else torch.cat(parts)).to(weight.device)  # the GPU's, there
    return BlockLinear(kernels, blocks, type_name, weight.shape[1], bias, weight.dtype)


def stacked_experts(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules that hold a mixture's experts as stacked [experts, …] tensors."""
    return [
        module
        for module in model.modules()
        if isinstance(getattr(module, "gate_up_proj", None), torch.nn.Parameter)
        and module.gate_up_proj.dim() == 3
    ]


def quantize_experts(experts: torch.nn.Module, kind: str, group: int) -> set[str]:
    """Each expert's gate/up and down matrices quantized on their own, as `_llmcli_gate_up` and
    `_llmcli_down` (one QuantizedLinear per expert, biases included: gpt-oss), one expert at a
    time; the stacked tensors are emptied. transformers' expert code can no longer run them:
    only the native engine, which reads these, runs a model quantized so (models/quant.py).
    Returns the kinds used: int4 where its group divides the input width, else int8."""
    kinds: set[str] = set()
    transposed = bool(getattr(experts, "is_transposed", False))  # gpt-oss stores [E, in, out]
    for name in ("gate_up_proj", "down_proj"):
        stacked = getattr(experts, name)
        biases = getattr(experts, f"{name}_bias", None)
        layers = torch.nn.ModuleList()
        for index in range(stacked.shape[0]):
            weight = stacked[index].T if transposed else stacked[index]
            bias = biases[index] if biases is not None else None
            fits = kind == "int4" and weight.shape[1] % group == 0 and _tinygemm_fits(weight)
            layer = QuantizedLinear.int4(weight, bias, group) if fits else QuantizedLinear.int8(weight, bias)
            kinds.add(layer.kind)
            layers.append(layer)
        setattr(experts, f"_llmcli_{name.removesuffix('_proj')}", layers)
        # Emptied, not deleted: the module keeps its attributes, and the memory goes back.
        setattr(experts, name, torch.nn.Parameter(stacked.new_empty(0), requires_grad=False))
    return kinds


class ExactCodes(Protocol):
    """int4 codes by module name, each (codes [N, K], scales and zeros [N, K / group]); `wider`:
    the layers of the same file stored with more than 4 bits, for int8; `int8`: a layer's int8
    codes and scales read from the file's blocks (int8_codes), None where it cannot."""

    group: int
    wider: frozenset[str]

    def __contains__(self, name: str) -> bool: ...

    def get(self, name: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]: ...

    def int8(self, name: str, scale_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor] | None: ...

    def block_type(self, name: str) -> str | None: ...

    def blocks(self, name: str) -> torch.Tensor | None: ...


def _tinygemm_fits(weight: torch.Tensor) -> bool:
    """CUDA's int4 kernel tiles the input by 16 × inner-k-tiles and the output by 8; the CPU's
    packs the output by 16 (a GGUF head of 4098 rows, say, stays int8)."""
    out_features, in_features = weight.shape
    if weight.device.type != "cuda":
        return out_features % 16 == 0
    return in_features % (16 * CUDA_INNER_K_TILES) == 0 and out_features % 8 == 0
