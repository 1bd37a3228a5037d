"""llmcli built from its sdist as pip builds it (setuptools' PEP 517 backend): the sdist carries
the kernels' C sources, a machine without a C compiler still gets a working wheel (torch's path),
and one with a compiler gets every level of its architecture. Everything is built from a copy in
a temporary folder: the source tree is left as it was."""

from __future__ import annotations

import os
import platform
import shlex
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import zipfile
from pathlib import Path

import pytest

pytest.importorskip("setuptools.command.bdist_wheel", reason="setuptools ≥ 70.1 builds llmcli's wheels")

ROOT = Path(__file__).resolve().parents[1]
PACKAGE_FILES = ("setup.py", "pyproject.toml", "README.md", "MANIFEST.in")
X86_64 = platform.machine().lower() in ("x86_64", "amd64")
COMPILER = shlex.split(sysconfig.get_config_var("CC") or "cc")[0]
NO_COMPILER = {"CC": "/bin/false", "LDSHARED": "/bin/false"}


def _source_tree_state() -> list[str]:
    """What a build would leave beside the sources (build/, *.egg-info, a dist/)."""
    return sorted([*os.listdir(ROOT), *(f"src/{name}" for name in os.listdir(ROOT / "src"))])


def _backend(hook: str, folder: Path, out: Path, env: dict[str, str] | None = None) -> Path:
    """Call setuptools' build backend as pip does (no isolation: this venv's setuptools)."""
    code = f"from setuptools import build_meta; print(build_meta.{hook}({str(out)!r}))"
    env = {**os.environ, **(env or {})}
    done = subprocess.run([sys.executable, "-c", code], cwd=folder, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    return out / done.stdout.strip().splitlines()[-1]


@pytest.fixture(scope="module")
def unpacked_sdist(tmp_path_factory: pytest.TempPathFactory) -> Path:
    before = _source_tree_state()
    copy = tmp_path_factory.mktemp("tree")
    for name in PACKAGE_FILES:
        shutil.copy2(ROOT / name, copy / name)
    built = shutil.ignore_patterns("*.so", "__pycache__", "*.egg-info")
    shutil.copytree(ROOT / "src", copy / "src", ignore=built)
    sdist = _backend("build_sdist", copy, tmp_path_factory.mktemp("sdist"))
    unpacked = tmp_path_factory.mktemp("unpacked")
    with tarfile.open(sdist) as archive:
        archive.extractall(unpacked, filter="data")
    yield next(unpacked.iterdir())
    assert _source_tree_state() == before


def test_the_sdist_carries_the_kernel_sources(unpacked_sdist: Path) -> None:
    sources = {path.name for path in (ROOT / "src" / "csrc").iterdir() if path.suffix in (".c", ".h")}
    assert sources and sources <= {path.name for path in (unpacked_sdist / "src" / "csrc").iterdir()}


def _wheel(unpacked_sdist: Path, out: Path, env: dict[str, str] | None = None) -> tuple[str, list[str]]:
    wheel = _backend("build_wheel", unpacked_sdist, out, env)
    with zipfile.ZipFile(wheel) as archive:
        return wheel.name, archive.namelist()


def test_without_a_compiler_llmcli_builds_and_runs_on_torch(unpacked_sdist: Path, tmp_path: Path) -> None:
    name, files = _wheel(unpacked_sdist, tmp_path / "wheel", NO_COMPILER)
    assert "-py3-none-" in name, name  # ctypes libraries: no Python ABI, one wheel for every Python
    assert not [file for file in files if file.endswith((".so", ".dylib", ".c", ".h"))]
    assert {file.split("/")[0] for file in files} == {"llmcli", "llmcli-0.1.0.dist-info"}
    installed = tmp_path / "installed"
    with zipfile.ZipFile(tmp_path / "wheel" / name) as archive:
        archive.extractall(installed)
    code = "from llmcli.models import cpu_kernels; print(cpu_kernels.which())"
    env = {**os.environ, "PYTHONPATH": str(installed)}
    said = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert said.stdout.strip().startswith("torch (llmcli was installed without its compiled kernels")


@pytest.mark.skipif(shutil.which(COMPILER) is None, reason=f"no C compiler ({COMPILER}) here")
def test_with_a_compiler_the_wheel_holds_every_level(unpacked_sdist: Path, tmp_path: Path) -> None:
    _, files = _wheel(unpacked_sdist, tmp_path)
    levels = ("portable", "avx2", "avx512") if X86_64 else ("portable",)
    libraries = sorted(file for file in files if file.endswith(".so"))
    assert libraries == sorted(f"llmcli/_cpu_{level}.so" for level in levels)
