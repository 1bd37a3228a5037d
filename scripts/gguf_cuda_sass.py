"""The GGUF GPU kernels (models/gguf_cuda_kernels.py) compiled for an H100 (sm_90) on this
machine, no GPU needed: Triton's wheel carries its compiler and ptxas. Per type and program
shape: registers, spills, and the GEMV's loop as machine code — its instructions, the thread
instructions it issues per weight byte, its barriers. An H100 issues about 30 T thread
instructions a second (132 SMs × 4 schedulers × 32 lanes × ~1.8 GHz): at 3 TB/s of copy
bandwidth, a GEMV issuing more than ~10 per byte is bound by its instructions, not the memory.
Not every instruction costs one issue slot's share of its pipe: the last column weighs them by
an SM's throughput per clock (CUDA's table for sm_90: fp32 128, integer and logic 64, memory
~32, conversions 16), in fp32-operation slots per byte — 128 a clock an SM, ~30 T a second.

    python scripts/gguf_cuda_sass.py           # the table
    python scripts/gguf_cuda_sass.py --check   # every kernel compiles, none spills (the tests run this)
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)  # compiled, not interpreted (read as kernels are decorated)

import triton
from triton.backends.compiler import GPUTarget

from llmcli.models import gguf_cuda, gguf_cuda_kernels

TOOLS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
CONFIGS = [(1, 4, 4), (1, 8, 4), (1, 16, 8), (1, 32, 8), (8, 4, 4), (8, 16, 8)]  # rows, BLOCK_N, warps
_DIVISIBLE = [["tt.divisibility", 16]]  # what Triton specializes at a launch on 8B's shapes


def compiled(kernel: str, type_name: str, block_m: int, block_n: int, warps: int, dtype: str) -> bytes:
    """The cubin of one kernel, for sm_90, specialized as a launch on 8B's shapes would be."""
    code = gguf_cuda._TYPES[type_name].code
    if kernel == "gemv":
        fn = gguf_cuda_kernels.gguf_gemv
        pointers, ints = {"x": f"*{dtype}", "w": "*u8", "out": f"*{dtype}"}, ["M", "N", "K", "row_bytes"]
        constants = {"TYPE": code, "BLOCK_M": block_m, "BLOCK_N": block_n}
    else:
        fn = gguf_cuda_kernels.gguf_dequantize
        pointers, ints = {"w": "*u8", "out": f"*{dtype}"}, ["N", "K", "row_bytes"]
        constants = {"TYPE": code, "BLOCK_N": block_n}
    signature = {**pointers, **dict.fromkeys(ints, "i32"), **dict.fromkeys(constants, "constexpr")}
    divisible = [*pointers, *(name for name in ints if name != "M")]
    attrs = {(fn.arg_names.index(name),): _DIVISIBLE for name in divisible}
    source = triton.compiler.ASTSource(fn=fn, signature=signature, constexprs=constants, attrs=attrs)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps}).asm["cubin"]


def tool(name: str, cubin: bytes, *options: str) -> str:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as file:
        file.write(cubin)
        file.flush()
        return subprocess.run(
            [TOOLS / name, *options, file.name], capture_output=True, text=True, check=True
        ).stdout


def resources(cubin: bytes) -> tuple[int, int]:
    """(registers, bytes of local memory: spills) a thread takes."""
    usage = tool("cuobjdump", cubin, "--dump-resource-usage")
    return int(re.search(r"REG:(\d+)", usage).group(1)), int(re.search(r"LOCAL:(\d+)", usage).group(1))


def loop_body(cubin: bytes) -> list[str]:
    """The instructions of the longest loop (the GEMV's walk along a row): from a backward
    branch's target to the branch."""
    lines = tool("cuobjdump", cubin, "-sass").splitlines()
    address = re.compile(r"/\*([0-9a-f]{4})\*/")
    loops = []
    for line in lines:
        branch = re.search(r"/\*([0-9a-f]{4})\*/.*BRA (0x[0-9a-f]+)", line)
        if branch and int(branch.group(2), 16) < int(branch.group(1), 16):
            loops.append((int(branch.group(2), 16), int(branch.group(1), 16)))
    start, end = max(loops, key=lambda loop: loop[1] - loop[0])
    return [line for line in lines if (at := address.search(line)) and start <= int(at.group(1), 16) <= end]


def _slots(line: str) -> int:
    """An instruction's cost in fp32-operation slots: 128 over its throughput per SM per clock."""
    operation = re.search(r"\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", line).group(1)
    if operation.startswith(("FFMA", "FADD", "FMUL", "HADD2", "HFMA2", "FSEL", "FMNMX")):
        return 1
    if operation.startswith(("I2F", "F2I", "F2F", "I2FP", "F2FP", "MUFU")):
        return 8
    if operation.startswith(("LDG", "STG", "LDS", "STS", "LDSM", "SHFL", "BAR")):
        return 4
    return 2


def check() -> int:
    """Every kernel of every type compiles for sm_90 in the shapes gguf_cuda launches, unspilled."""
    failures = []
    block_n, warps = gguf_cuda._block_n(_cuda()), gguf_cuda._WARPS
    for type_name in sorted(gguf_cuda.TYPES):
        for kernel, rows, dtype in [
            ("gemv", 1, "bf16"),
            ("gemv", gguf_cuda.GEMV_MAX_ROWS, "fp32"),
            ("dequantize", 1, "bf16"),
        ]:
            registers, spilled = resources(compiled(kernel, type_name, rows, block_n, warps, dtype))
            print(f"{type_name} {kernel} rows {rows} {dtype}: {registers} registers, {spilled} bytes spilled")
            if spilled:
                failures.append(f"{type_name} {kernel}")
    print("spilled: " + ", ".join(failures) if failures else "every kernel compiles for sm_90 unspilled")
    return 1 if failures else 0


def _cuda() -> object:
    import torch

    return torch.device("cuda")


def table() -> None:
    columns = ["type", "rows", "BLOCK_N × warps", "registers", "loop instructions", "per weight byte"]
    print("| " + " | ".join([*columns, "barriers", "weighted"]) + " |")
    print("|---|---|---|---|---|---|---|---|")
    for type_name in sorted(gguf_cuda.TYPES):
        kind = gguf_cuda._TYPES[type_name]
        tile_bytes = kind.nbytes * 256 // kind.values
        for rows, block_n, warps in CONFIGS:
            cubin = compiled("gemv", type_name, rows, block_n, warps, "bf16")
            registers, _ = resources(cubin)
            body = loop_body(cubin)
            per_byte = len(body) * 32 * warps / (block_n * tile_bytes)
            barriers = sum("BAR.SYNC" in line for line in body)
            weighted = sum(_slots(line) for line in body) * 32 * warps / (block_n * tile_bytes)
            shape = f"{block_n} × {warps}"
            cells = [type_name, rows, shape, registers, len(body), f"{per_byte:.1f}", barriers]
            cells.append(f"{weighted:.1f}")
            print("| " + " | ".join(str(cell) for cell in cells) + " |", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description="the GGUF GPU kernels compiled for sm_90 here")
    parser.add_argument("--check", action="store_true", help="compile every kernel; fail on a spill")
    if not (TOOLS / "ptxas").exists():
        print(f"triton's CUDA tools are not at {TOOLS}", file=sys.stderr)
        return 2
    if parser.parse_args().check:
        return check()
    table()
    return 0


if __name__ == "__main__":
    sys.exit(main())
