"""Where the Triton kernels' tests run: on the GPU where there is one, else on CPU tensors
through Triton's interpreter (TRITON_INTERPRET=1), so CI checks every kernel without a GPU.

Triton reads TRITON_INTERPRET as each function is decorated, its own library's as it is
imported, so conftest.py sets it before any test module imports anything. The interpreter runs
a program's block operations with numpy, one program at a time: shapes here stay small, but they
still cross every boundary (ragged widths, one row, many rows, groups).
"""

from __future__ import annotations

import os
import sys

import pytest
import torch


def kernel_device() -> torch.device:
    """cuda when a GPU is present; else cpu with the interpreter switched on."""
    if torch.cuda.is_available():
        return torch.device("cuda")
    if not sys.platform.startswith("linux"):  # triton ships wheels for Linux only
        pytest.skip("triton installs on Linux only")
    import triton  # noqa: F401  (the test extra installs it: a missing triton is an error here)

    assert os.environ.get("TRITON_INTERPRET") == "1", "conftest.py sets the interpreter before imports"
    return torch.device("cpu")
