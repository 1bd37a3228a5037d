"""llmcli's compiled CPU kernels (src/csrc/), built when a C compiler is found.

The same sources are compiled once per instruction-set level — portable (the baseline of the
architecture: SSE2 on x86-64, NEON on arm64), AVX2 + FMA, and AVX-512 with VNNI and BF16 — and
llmcli loads the best one the running CPU can execute (models/cpu_kernels.py): one build for every
CPU of an architecture, never -march=native. Each library is plain C called through ctypes on
tensors' data pointers: nothing links against Python's or torch's C API, so any torch works — and
any Python: the libraries are named without a Python tag (`_cpu_avx2.so`) and the wheel is tagged
py3-none-<platform>, one wheel per platform for every Python llmcli supports.

Every extension is optional: where no compiler is found, or one level does not compile, pip still
installs llmcli, which runs those products on torch and says so (`llmcli bench --json`).
Everything else about the package is in pyproject.toml.
"""

from __future__ import annotations

import platform
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

try:
    from setuptools.command.bdist_wheel import bdist_wheel
except ImportError:  # setuptools < 70.1, met where build isolation is off: wheel's own
    from wheel.bdist_wheel import bdist_wheel

SOURCES = sorted(str(path) for path in Path("src/csrc").glob("*.c"))
COMMON = ["-O3", "-std=gnu11", "-fvisibility=hidden", "-pthread", "-fno-math-errno"]
AVX2 = ["-mavx2", "-mfma", "-mf16c", "-mbmi2"]
AVX512 = [*AVX2, "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512vnni", "-mavx512bf16"]


def kernels(level: str, flags: list[str]) -> Extension:
    return Extension(
        f"llmcli._cpu_{level}",
        sources=SOURCES,
        depends=sorted(str(path) for path in Path("src/csrc").glob("*.h")),
        extra_compile_args=[*COMMON, *flags],
        extra_link_args=["-pthread"],
        libraries=["m"],  # expf, tanhf: linked, not left to whatever loaded the library first
        optional=True,  # a failed build leaves llmcli on its torch path, never uninstallable
    )


def extensions() -> list[Extension]:
    if sys.platform == "win32":  # MSVC takes none of these flags; torch's path serves there
        return []
    machine = platform.machine().lower()
    levels = [kernels("portable", [])]
    if machine in ("x86_64", "amd64"):
        levels += [kernels("avx2", AVX2), kernels("avx512", AVX512)]
    return levels


class SharedLibraries(build_ext):
    """Each level as `llmcli/_cpu_<level>.so`, without Python's ABI tag: ctypes loads it, so one
    file serves every Python version (cpu_kernels.py looks for exactly this name)."""

    def get_ext_filename(self, fullname: str) -> str:
        return str(Path(*fullname.split("."))) + ".so"


class AnyPythonWheel(bdist_wheel):
    """py3-none-<platform>: the libraries hold machine code for a platform but nothing of
    CPython's ABI, so the wheel claims the platform only."""

    def get_tag(self) -> tuple[str, str, str]:
        _python, _abi, platform_tag = super().get_tag()
        return "py3", "none", platform_tag


setup(ext_modules=extensions(), cmdclass={"build_ext": SharedLibraries, "bdist_wheel": AnyPythonWheel})
