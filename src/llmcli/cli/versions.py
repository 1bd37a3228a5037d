"""`llmcli --version`: our version, the libraries that decide behaviour, and the GPU seen."""

from __future__ import annotations

from importlib import metadata

from llmcli import __version__


def _installed(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "not installed"


def version_report() -> str:
    import torch  # the device line needs it; --version is allowed to take a second

    if torch.cuda.is_available():
        devices = ", ".join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count()))
        device = f"CUDA {torch.version.cuda}: {devices}"
    else:
        device = "CPU only"
    return "\n".join(
        [
            f"llmcli {__version__}",
            f"torch {torch.__version__}",
            f"transformers {_installed('transformers')}",
            f"bitsandbytes {_installed('bitsandbytes')}",
            f"device {device}",
        ]
    )
