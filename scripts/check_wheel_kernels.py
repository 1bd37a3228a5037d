"""The check cibuildwheel runs on each wheel it built (pyproject.toml's [tool.cibuildwheel]
test-command), in a fresh environment with the wheel installed: every level of the platform is
in the wheel (setup.py's extensions are optional, so a level that failed to compile would
otherwise ship unnoticed), the best one this CPU runs loads, and it multiplies a block.

  python scripts/check_wheel_kernels.py
"""

from __future__ import annotations

import platform
import sys

import torch

from llmcli.models import cpu_kernels


def main() -> int:
    x86_64 = platform.machine().lower() in ("x86_64", "amd64")
    expected = {"portable", "avx2", "avx512"} if x86_64 else {"portable"}
    built = set(cpu_kernels.built_levels())
    if built != expected:
        print(f"the wheel holds the {sorted(built)} kernels, not {sorted(expected)}", file=sys.stderr)
        return 1
    loaded = cpu_kernels.kernels()
    if loaded is None:
        print(f"no kernels load here: {cpu_kernels.which()}", file=sys.stderr)
        return 1
    # One Q8_0 block of 32 weights, all 1 with scale 1 (fp16 0x3C00), times a row of 127s (which
    # quantize exactly, with scale 1): 32 × 127.
    block = torch.tensor([0x00, 0x3C] + [1] * 32, dtype=torch.uint8)
    product = loaded.matmul(torch.full((1, 32), 127.0), block, "Q8_0", 1).item()
    if product != 32 * 127:
        print(
            f"the {loaded.level} kernels multiplied a Q8_0 block to {product}, not {32 * 127}",
            file=sys.stderr,
        )
        return 1
    print(f"{cpu_kernels.which()}: levels {sorted(built)}, types {sorted(loaded.types)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
