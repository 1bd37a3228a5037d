"""llmcli's compiled CPU kernels (src/csrc/), loaded through ctypes and called on tensors' data
pointers: GGUF blocks multiplied in integers as llama.cpp multiplies them.

setup.py compiles the same C sources once per instruction-set level (`LEVELS`); the best level
the running CPU can execute is loaded, so one installed package serves every CPU of its
architecture and none ever meets an instruction it lacks. `LLMCLI_CPU_KERNELS` chooses instead:
`auto` (the default), a level by name (refused, in one line, where this CPU cannot run it), or
`off` (torch's kernels, as a package built without a compiler runs). `which()` says, for
`--json` and bench, which kernels multiply.
"""

from __future__ import annotations

import ctypes
import functools
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from llmcli.errors import UsageError

if TYPE_CHECKING:
    import torch

ENV = "LLMCLI_CPU_KERNELS"
# Best first. Each level's bits (src/csrc/matmul.c's F_*) are the features it was compiled for.
LEVELS = ("avx512", "avx2", "portable")
_AVX2_BITS = 1 | 2 | 4 | 1024  # AVX2, FMA, F16C, BMI2
_NEEDS = {"avx512": _AVX2_BITS | 8 | 16 | 32 | 64 | 128 | 512, "avx2": _AVX2_BITS, "portable": 0}
_FEATURE_NAMES = {
    1: "avx2", 2: "fma", 4: "f16c", 8: "avx512f", 16: "avx512bw", 32: "avx512vl", 64: "avx512vnni",
    128: "avx512bf16", 256: "neon", 512: "avx512dq", 1024: "bmi2",
}  # fmt: skip
# ggml's type ids (GGUF's tensor types) of the types the kernels may multiply.
TYPE_IDS = {
    "F16": 1, "Q4_0": 2, "Q4_1": 3, "Q5_0": 6, "Q5_1": 7, "Q8_0": 8, "Q2_K": 10, "Q3_K": 11,
    "Q4_K": 12, "Q5_K": 13, "Q6_K": 14, "IQ4_NL": 20, "IQ4_XS": 23, "BF16": 30,
}  # fmt: skip
_PACKAGE = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class CpuKernels:
    """One loaded level of the kernels."""

    level: str
    library: ctypes.CDLL

    @functools.cached_property
    def types(self) -> frozenset[str]:
        """The GGUF types this build multiplies."""
        return frozenset(name for name, type_id in TYPE_IDS.items() if self.library.llmcli_has_type(type_id))

    def matmul(self, x: torch.Tensor, blocks: torch.Tensor, type_name: str, rows: int) -> torch.Tensor:
        """x [m, k] (contiguous) times the matrix whose `rows` rows `blocks` holds in `type_name`,
        transposed: [m, rows], in x's dtype where it is fp32, bf16 or fp16 (read and written as
        they are), else in fp32."""
        import torch

        if dtype_code(x.dtype) is None:
            x = x.float()
        code = dtype_code(x.dtype)
        m, k = x.shape
        y = torch.empty((m, rows), dtype=x.dtype)
        done = self.library.llmcli_matmul(
            TYPE_IDS[type_name], blocks.data_ptr(), rows, k, x.data_ptr(), code, m, y.data_ptr(), code,
            kernel_threads(),
        )  # fmt: skip
        if done != 0:
            raise ValueError(f"llmcli's {self.level} kernels cannot multiply {type_name} rows of {k}")
        return y

    def dequantized(
        self, blocks: torch.Tensor, type_name: str, rows: int, k: int, dtype: torch.dtype
    ) -> torch.Tensor:
        """The matrix's values [rows, k] in `dtype` (fp32, bf16 or fp16), read on every thread:
        what a prefill multiplies by torch's GEMM (faster than the block products from ~32 rows
        on, measured in docs/benchmarks.md)."""
        import torch

        out = torch.empty((rows, k), dtype=dtype)
        code = dtype_code(dtype)
        read = self.library.llmcli_dequantize_to(
            TYPE_IDS[type_name], blocks.data_ptr(), rows, k, out.data_ptr(), code, kernel_threads()
        )
        if read != 0:
            raise ValueError(f"llmcli's {self.level} kernels cannot read {type_name} rows of {k}")
        return out

    def dequantize(self, blocks: torch.Tensor, type_name: str, rows: int, k: int) -> torch.Tensor:
        """The values of `rows` rows of `k` stored in `blocks`, in fp32 (the tests' reference
        is gguf's own dequantization)."""
        import torch

        out = torch.empty((rows, k), dtype=torch.float32)
        read = self.library.llmcli_dequantize(TYPE_IDS[type_name], blocks.data_ptr(), rows, k, out.data_ptr())
        if read != 0:
            raise ValueError(f"llmcli's {self.level} kernels cannot read {type_name} rows of {k}")
        return out


_threads: int | None = None  # set by a load whose model runs on the kernels (run_on_kernels)


def kernel_threads() -> int:
    """The threads the kernels' pool runs on: the load's choice, else torch's."""
    import torch

    return _threads or torch.get_num_threads()


def run_on_kernels(threads: int) -> None:
    """A model whose decode steps are the kernels' products: they take `threads` threads, and
    torch's own calls between them one. Measured on 2 cores (a width-1024 Q4_K_M file, decode):
    the kernels on 2 threads and torch on 1, 4.0 ms a step; both on 2, 78 ms, torch's OpenMP
    workers spinning on the core the pool's worker needs after every call of theirs; everything
    on one thread, 4.8 ms. A prefill's GEMM takes the threads back (block_linear.py)."""
    import torch

    global _threads
    _threads = threads
    torch.set_num_threads(1)


def dtype_code(dtype: torch.dtype) -> int | None:
    """src/csrc/llmcli_cpu.h's code for a dtype rows may come in and go out in; None for others."""
    import torch

    return {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}.get(dtype)


def _library_path(level: str) -> Path | None:
    # The name setup.py gives each level: no Python tag, one file for every Python version (and
    # a library left by an older build under a tagged name is never loaded in its stead).
    path = _PACKAGE / f"_cpu_{level}.so"
    return path if path.is_file() else None


def _open(path: Path) -> ctypes.CDLL:
    library = ctypes.CDLL(str(path))
    c_int, c_int64, c_void_p, c_float = ctypes.c_int, ctypes.c_int64, ctypes.c_void_p, ctypes.c_float
    # engine/native/paged_cpu.py: dtype, q, keys, values, tables, max_blocks, num_blocks, lengths,
    # sinks, batch, q_tokens, heads, kv_heads, head_dim, block_size, scale, window, softcap, out, threads
    paged = [
        c_int, *[c_void_p] * 4, c_int64, c_int64, c_void_p, c_void_p, *[c_int64] * 6, c_float, c_int64,
        c_float, c_void_p, c_int,
    ]  # fmt: skip
    # type, weights, n, k, x, x's dtype, m, y, y's dtype, threads
    matmul = [c_int, c_void_p, c_int64, c_int64, c_void_p, c_int, c_int64, c_void_p, c_int, c_int]
    signatures = {
        "llmcli_matmul": matmul,
        "llmcli_paged_attention": paged,
        "llmcli_dequantize": [c_int, c_void_p, c_int64, c_int64, c_void_p],
        # type, blocks, rows, k, out, out's dtype, threads
        "llmcli_dequantize_to": [c_int, c_void_p, c_int64, c_int64, c_void_p, c_int, c_int],
        "llmcli_has_type": [c_int],
        "llmcli_cpu_features": [],
        "llmcli_build_features": [],
    }
    for name, arguments in signatures.items():
        function = getattr(library, name)
        function.argtypes, function.restype = arguments, c_int
    return library


def built_levels() -> tuple[str, ...]:
    """The levels this installation has a library for."""
    return tuple(level for level in LEVELS if _library_path(level) is not None)


@functools.cache
def _cpu_bits() -> int:
    """What this CPU (and its operating system) can execute, as the portable build reads it
    (src/csrc/matmul.c's F_* bits); 0 without one."""
    path = _library_path("portable")
    return _open(path).llmcli_cpu_features() if path is not None else 0


def cpu_features() -> frozenset[str]:
    """What this CPU (and its operating system) can execute, by name."""
    return frozenset(name for bit, name in _FEATURE_NAMES.items() if _cpu_bits() & bit)


def runs_here(level: str) -> bool:
    """Whether this CPU has every feature `level` was compiled for (a portable build to ask)."""
    return _library_path("portable") is not None and _cpu_bits() & _NEEDS[level] == _NEEDS[level]


def missing_features(level: str) -> list[str]:
    return [name for bit, name in _FEATURE_NAMES.items() if _NEEDS[level] & bit and not _cpu_bits() & bit]


def check_choice() -> None:
    """LLMCLI_CPU_KERNELS checked before a model is looked for: a name that is no level, or a
    level this installation lacks or this CPU cannot run, is refused in one line (UsageError)."""
    kernels()


def _asked() -> str:
    asked = os.environ.get(ENV, "auto").strip().lower() or "auto"
    if asked not in ("auto", "off", *LEVELS):
        levels = ", ".join(LEVELS)
        raise UsageError(f"{ENV}={asked} is not a kernel level: choose auto, off, or one of {levels}")
    return asked


@functools.cache
def _load(asked: str) -> CpuKernels | None:
    if asked == "off":
        return None
    if asked != "auto":
        path = _library_path(asked)
        if path is None:
            built = _built_text()
            raise UsageError(f"{ENV}={asked}: this installation has no {asked} kernels (built: {built})")
        if not runs_here(asked):
            lacking = ", ".join(missing_features(asked))
            raise UsageError(f"{ENV}={asked}: this CPU cannot run them (it lacks {lacking})")
        return CpuKernels(asked, _open(path))
    for level in LEVELS:
        path = _library_path(level)
        if path is not None and runs_here(level):
            return CpuKernels(level, _open(path))
    return None


# The types torch's path holds as well as the kernels do, and runs faster today: 4-bit blocks
# as int4 codes on the file's own grid (tinygemm), 16-bit weights as they are. Measured beside
# llama.cpp (docs/benchmarks.md, decode, 2 threads, kernels against torch's path): the demo's
# Q4_1 0.66x, Q4_0 0.87x, F16 0.89x, Q4_K_M 1.03x; Q6_K 1.18x, IQ4_XS 1.06x, Q8_0 0.98x.
TORCH_HOLDS_AS_WELL = frozenset({"Q4_0", "Q4_1", "Q4_K", "F16", "BF16"})


def takes_file(types: frozenset[str]) -> bool:
    """Whether a GGUF file whose linear layers are of `types` runs on the kernels: under `auto`,
    a file none of whose layers torch's path holds as well (the 5-8-bit, IQ4 and Q2/Q3 types,
    which torch's path requantizes to int8: more memory, another grid); a level named in
    LLMCLI_CPU_KERNELS, every file the kernels have the types of."""
    if _asked() != "auto":
        return kernels() is not None
    return kernels() is not None and not types & TORCH_HOLDS_AS_WELL


def kernels() -> CpuKernels | None:
    """The kernels llmcli multiplies with on this CPU, or None (torch's kernels run)."""
    return _load(_asked())


def _built_text() -> str:
    return ", ".join(built_levels()) or "none"


def which() -> str:
    """What multiplies a GGUF file's blocks here, in a few words (for --json and bench)."""
    loaded = kernels()
    if loaded is not None:
        return f"llmcli {loaded.level}"
    if _asked() == "off":
        return f"torch ({ENV}=off)"
    if not built_levels():
        return "torch (llmcli was installed without its compiled kernels: no C compiler was found)"
    return "torch (this CPU runs none of the compiled kernels)"


def which_on(device: torch.device, quant: str) -> str | None:
    """What multiplies the layers of a model loaded as `quant` (LoadedModel.quant), where it runs
    on the CPU; None elsewhere: these are CPU kernels."""
    if device.type != "cpu":
        return None
    loaded = kernels()
    if quant.startswith("gguf-blocks") or loaded is None:
        return which()
    level = loaded.level
    return f"torch (this model's layers; llmcli's {level} kernels take GGUF files torch would requantize)"


_torch_noted = False


def load_note(device: torch.device, gguf: bool) -> str | None:
    """Said once per process, where a GGUF file loads on the CPU of an installation built without
    the kernels: its products run on torch, slower, and the user can change that."""
    global _torch_noted
    if _torch_noted or not gguf or device.type != "cpu" or built_levels():
        return None
    _torch_noted = True
    return (
        "llmcli was installed without its compiled CPU kernels (no C compiler was found): this GGUF "
        "file's products run on torch, slower — reinstall with a C compiler, or from a wheel"
    )
