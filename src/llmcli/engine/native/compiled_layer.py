"""A Llama-style block run by llmcli's compiled kernels around its attention (src/csrc/layer.c):
one call from the residual stream to q, k and v, one from attention's output to the next
residual stream. Taken where every matrix of the block is a GGUF file's blocks the kernels
multiply (models/block_linear.py) and the block is the plain one (RMSNorm, SwiGLU, RoPE by
rotate-half, optional q/k norms and q/k/v biases); anything else keeps the torch path, as does
every block under LLMCLI_CPU_FUSED=0. Attention stays with the pass's plan, which owns the cache.

Measured on the demo: a CPU decode step on the torch path spends more time in the ~30 small
calls per block these two replace than in the products (docs/benchmarks.md)."""

from __future__ import annotations

import ctypes
import os
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from llmcli.engine.native.layers import FeedForward, RMSNorm, identity
from llmcli.errors import UsageError
from llmcli.models.block_linear import GEMM_ROWS, BlockLinear
from llmcli.models.cpu_kernels import TYPE_IDS, CpuKernels, dtype_code, kernel_threads

if TYPE_CHECKING:
    from llmcli.engine.native.attention import Attention
    from llmcli.engine.native.plans import Plan

ENV = "LLMCLI_CPU_FUSED"
MAX_HEAD_DIM = 1024  # src/csrc/layer.c's finish_head
_POINTER, _INT64 = ctypes.c_void_p, ctypes.c_int64


class _Matrix(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("w", _POINTER), ("n", _INT64), ("bias", _POINTER)]


class _LayerWeights(ctypes.Structure):
    """src/csrc/layer.c's layer_weights, field for field."""

    _fields_ = [
        ("hidden", _INT64), ("heads", _INT64), ("kv_heads", _INT64), ("head_dim", _INT64),
        ("rot_width", _INT64), ("intermediate", _INT64), ("eps", ctypes.c_float),
        ("attention_norm", _POINTER), ("ffn_norm", _POINTER), ("q_norm", _POINTER), ("k_norm", _POINTER),
        ("qkv_parts", _INT64), ("qkv", _Matrix * 3), ("out", _Matrix),
        ("gate_up_parts", _INT64), ("gate_up", _Matrix * 2), ("down", _Matrix),
    ]  # fmt: skip


def _checked(code: int) -> None:
    """layer.c's answer: 0, or what it could not do (never a result left half written)."""
    if code == -2:
        raise MemoryError("llmcli's compiled block could not allocate its scratch rows")
    if code != 0:
        raise ValueError(f"llmcli's compiled block refused its shapes (code {code})")


def fused_layers_wanted() -> bool:
    value = os.environ.get(ENV, "1").strip()
    if value not in ("0", "1"):
        raise UsageError(f"{ENV}={value}: 0 (each small step on torch) or 1 (the default)")
    return value == "1"


def _parts(modules: list[Any]) -> list[BlockLinear] | None:
    """The BlockLinear matrices that compute `modules` side by side: one whole the quantizer
    fused them into (each a QuantizedSlice of it, in order), or each its own; None otherwise."""
    from llmcli.models.quantized import QuantizedSlice

    if all(isinstance(module, QuantizedSlice) for module in modules):
        whole = modules[0].whole
        ends = [0] + [module.end for module in modules]
        in_order = all(m.whole is whole and m.start == end for m, end in zip(modules, ends, strict=False))
        if in_order and ends[-1] == whole.out_features and isinstance(whole, BlockLinear):
            return [whole]
        return None
    return list(modules) if all(isinstance(module, BlockLinear) for module in modules) else None


class CompiledLayer:
    def __init__(
        self, kernels: CpuKernels, weights: _LayerWeights, held: list[Any], dtype: torch.dtype
    ) -> None:
        self.kernels, self.weights, self._held = (
            kernels,
            weights,
            held,
        )  # `held`: what its pointers point into
        self.dtype = dtype
        self._reference = ctypes.byref(weights)
        library = kernels.library
        self._attention_in = library.llmcli_layer_attention_in
        self._feed_forward = library.llmcli_layer_feed_forward
        c_int, layer = ctypes.c_int, ctypes.POINTER(_LayerWeights)
        # layer, h, rows, cos, sin, their dtype, q, k, v, their dtype, threads (dtypes: dtype_code)
        self._attention_in.argtypes = [
            layer,
            _POINTER,
            _INT64,
            _POINTER,
            _POINTER,
            c_int,
            *[_POINTER] * 3,
            c_int,
            c_int,
        ]
        # layer, h, rows, attention's output, its dtype, h out, threads
        self._feed_forward.argtypes = [layer, _POINTER, _INT64, _POINTER, c_int, _POINTER, c_int]
        self._attention_in.restype = self._feed_forward.restype = c_int

    @classmethod
    def of(cls, layer: Any, block: Any) -> CompiledLayer | None:
        """`block` (families/base.py's Block, built from the model's `layer`) compiled, where its
        matrices and pieces allow (see the module's docstring)."""
        attention, feed_forward = block.attention, block.feed_forward
        norms = (block.attention_norm, block.ffn_norm)
        if attention is None or not all(type(norm) is RMSNorm for norm in norms):
            return None
        if type(feed_forward) is not FeedForward or feed_forward.activation is not F.silu:
            return None
        extra_norms = [n for n in (attention.q_norm, attention.k_norm) if n is not identity]
        if any(type(norm) is not RMSNorm for norm in extra_norms) or len(extra_norms) == 1:
            return None
        if len({norm.eps for norm in (*norms, *extra_norms)}) != 1 or not fused_layers_wanted():
            return None
        self_attn, mlp = layer.self_attn, layer.mlp
        qkv = _parts([getattr(self_attn, name, None) for name in ("q_proj", "k_proj", "v_proj")])
        out = _parts([getattr(self_attn, "o_proj", None)])
        gate_up = _parts([getattr(mlp, name, None) for name in ("gate_proj", "up_proj")])
        down = _parts([getattr(mlp, "down_proj", None)])
        if qkv is None or out is None or gate_up is None or down is None:
            return None
        matrices = [*qkv, *out, *gate_up, *down]
        kernels = matrices[0].kernels
        if any(m.kernels is not kernels or m.type_name not in kernels.types for m in matrices):
            return None
        if not isinstance(kernels, CpuKernels):  # a GPU's blocks (gguf_cuda.py): torch's calls run them
            return None
        shape = attention.shape
        if shape.head_dim > MAX_HEAD_DIM:  # layer.c rotates a head in a buffer of this many values
            return None
        held: list[Any] = []

        def pointer(tensor: torch.Tensor | None) -> int | None:
            if tensor is None:
                return None
            tensor = tensor.detach().float().contiguous()
            held.append(tensor)
            return tensor.data_ptr()

        def matrix(linear: BlockLinear) -> _Matrix:
            held.append(linear.blocks)
            return _Matrix(
                TYPE_IDS[linear.type_name],
                linear.blocks.data_ptr(),
                linear.out_features,
                pointer(linear.bias),
            )

        weights = _LayerWeights(
            hidden=qkv[0].in_features, heads=shape.heads, kv_heads=shape.kv_heads, head_dim=shape.head_dim,
            rot_width=shape.head_dim, intermediate=feed_forward.intermediate, eps=block.attention_norm.eps,
            attention_norm=pointer(block.attention_norm.weight), ffn_norm=pointer(block.ffn_norm.weight),
            q_norm=pointer(extra_norms[0].weight) if extra_norms else None,
            k_norm=pointer(extra_norms[1].weight) if extra_norms else None,
            qkv_parts=len(qkv), out=matrix(out[0]), gate_up_parts=len(gate_up), down=matrix(down[0]),
        )  # fmt: skip
        for index, linear in enumerate(qkv):
            weights.qkv[index] = matrix(linear)
        for index, linear in enumerate(gate_up):
            weights.gate_up[index] = matrix(linear)
        return cls(kernels, weights, held, block.attention_norm.dtype)

    def __call__(
        self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, plan: Plan, attention: Attention
    ) -> torch.Tensor:
        rows, shape = h.shape[0], attention.shape
        d, dtype, threads = shape.head_dim, self.dtype, kernel_threads()
        self.weights.rot_width = cos.shape[-1]
        q = torch.empty((rows, shape.heads, d), dtype=dtype)
        k = torch.empty((rows, shape.kv_heads, d), dtype=dtype)
        v = torch.empty((rows, shape.kv_heads, d), dtype=dtype)
        code = dtype_code(dtype)
        _checked(self._attention_in(
            self._reference, h.data_ptr(), rows, cos.data_ptr(), sin.data_ptr(), dtype_code(cos.dtype),
            q.data_ptr(), k.data_ptr(), v.data_ptr(), code, threads,
        ))  # fmt: skip
        attended = plan.attend(
            attention, q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)
        ).contiguous()
        out = torch.empty_like(h)
        a_dtype = dtype_code(attended.dtype)
        _checked(
            self._feed_forward(
                self._reference, h.data_ptr(), rows, attended.data_ptr(), a_dtype, out.data_ptr(), threads
            )
        )
        return out

    def usable(self, h: torch.Tensor, cos: torch.Tensor) -> bool:
        """Whether this pass's tensors are the layouts the C code reads, and few enough rows that
        the block products beat a GEMM (a prefill takes torch's calls, block_linear.GEMM_ROWS)."""
        return (
            h.shape[0] < GEMM_ROWS and h.dtype == torch.float32 and h.dim() == 2 and h.is_contiguous()
            and cos.is_contiguous() and dtype_code(cos.dtype) is not None and cos.shape[0] == h.shape[0]
            and dtype_code(self.dtype) is not None
        )  # fmt: skip
