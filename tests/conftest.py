from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from tiny_models import build_tiny_model


@pytest.fixture(scope="session", autouse=True)
def isolated_home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """No test reads or writes the real user's caches, and none reaches the network."""
    home = tmp_path_factory.mktemp("home")
    os.environ["XDG_CACHE_HOME"] = str(home / "cache")
    os.environ["HF_HOME"] = str(home / "hf")
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ.pop("LLMCLI_MODEL", None)
    os.environ.pop("LLMCLI_CACHE_DIR", None)
    return home


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny-llama", "llama")


@pytest.fixture(scope="session")
def tiny_qwen2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny-qwen2", "qwen2")


@pytest.fixture(scope="session", params=["llama", "qwen2"])
def tiny_model(request: pytest.FixtureRequest, tiny_llama: Path, tiny_qwen2: Path) -> Path:
    return {"llama": tiny_llama, "qwen2": tiny_qwen2}[request.param]


@pytest.fixture(scope="session")
def loaded_tiny(tiny_model: Path):
    """The tiny model loaded through llmcli's own loader (CPU, fp32)."""
    from llmcli.load import load_model
    from llmcli.resolve import resolve_model
    from llmcli.settings import LoadSettings

    return load_model(resolve_model(str(tiny_model)), LoadSettings(device="cpu", threads=1))
