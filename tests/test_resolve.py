"""Model resolution: the HF cache layout, local folders, pickles, and failing fast offline."""

from __future__ import annotations

import shutil
import socket
import threading
from pathlib import Path

import pytest

from llmcli.errors import EXIT_FAILURE, ModelLoadError, ModelNotFoundError, NetworkError, UnsafeWeightsError
from llmcli.models.default_model import DEFAULT_HUB_MODEL, default_model_spec, demo_gguf_path
from llmcli.models.resolve import resolve_model

from cli_helpers import run_cli
from tiny_models import COMMIT, put_in_hf_cache


@pytest.fixture(scope="module")
def hf_home(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory, monkeypatch_module) -> Path:
    home = tmp_path_factory.mktemp("hf-home")
    put_in_hf_cache(tiny_llama, home, "tiny-org/tiny-llama")
    from huggingface_hub import constants

    monkeypatch_module.setattr(constants, "HF_HUB_CACHE", str(home / "hub"))
    monkeypatch_module.setenv("HF_HOME", str(home))
    return home


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as patch:
        yield patch


def test_hub_id_resolves_from_the_local_cache(hf_home: Path) -> None:
    resolved = resolve_model("tiny-org/tiny-llama")
    assert resolved.source == "hub"
    assert resolved.path == hf_home / "hub" / "models--tiny-org--tiny-llama" / "snapshots" / COMMIT
    assert (resolved.path / "config.json").is_file()


def test_hub_id_with_revision_resolves_from_the_local_cache(hf_home: Path) -> None:
    resolved = resolve_model(f"tiny-org/tiny-llama@{COMMIT}")
    assert resolved.path.name == COMMIT
    assert resolved.name == f"tiny-org/tiny-llama@{COMMIT}"


def test_uncached_hub_id_offline_names_what_was_tried(hf_home: Path) -> None:
    with pytest.raises(NetworkError) as caught:
        resolve_model("tiny-org/not-cached")
    line = caught.value.one_line()
    assert "tiny-org/not-cached" in line and str(hf_home / "hub") in line and "HF_HUB_OFFLINE" in line


def test_cached_model_loads_and_generates_through_the_cli(hf_home: Path) -> None:
    proc = run_cli("generate", "-m", "tiny-org/tiny-llama", "-t", "0", "-n", "5", "--json", "hi")
    assert proc.returncode == 0, proc.stderr.decode()
    assert b'"model": "tiny-org/tiny-llama"' in proc.stdout


@pytest.mark.parametrize("spec", ["not a model", "./missing-folder", "a/b/c/d"])
def test_specs_that_are_nothing_are_refused(spec: str) -> None:
    with pytest.raises(ModelNotFoundError, match=r"not a folder, a \.gguf file or a Hub id"):
        resolve_model(spec)


def test_folder_without_config_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match=r"no config\.json"):
        resolve_model(str(tmp_path))


@pytest.fixture(scope="module")
def pickled_model(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    import torch
    from safetensors.torch import load_file

    folder = tmp_path_factory.mktemp("pickled")
    for file in tiny_llama.iterdir():
        if file.suffix != ".safetensors":
            shutil.copy(file, folder / file.name)
    torch.save(load_file(tiny_llama / "model.safetensors"), folder / "pytorch_model.bin")
    return folder


def test_pickled_weights_are_refused_by_default(pickled_model: Path) -> None:
    with pytest.raises(UnsafeWeightsError, match="pickled weights"):
        resolve_model(str(pickled_model))
    proc = run_cli("generate", "-m", str(pickled_model), "hi")
    assert proc.returncode == EXIT_FAILURE
    assert "--allow-pickle" in proc.stderr.decode()


def test_pickled_weights_load_when_allowed(pickled_model: Path, tiny_llama: Path) -> None:
    args = ["generate", "-t", "0", "-n", "8", "--json", "Hello"]
    pickled = run_cli(*args, "-m", str(pickled_model), "--allow-pickle")
    safe = run_cli(*args, "-m", str(tiny_llama))
    assert pickled.returncode == 0, pickled.stderr.decode()
    assert b'"text"' in pickled.stdout
    assert pickled.stdout.split(b'"model"')[0] == safe.stdout.split(b'"model"')[0]  # same text


@pytest.fixture
def silent_hub():
    """A local server that accepts connections and never answers: a hung network, on loopback.
    Yields its URL and the connections it took."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(16)
    accepted: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        server.settimeout(0.2)
        while not stop.is_set():
            try:
                accepted.append(server.accept()[0])
            except OSError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.getsockname()[1]}", accepted
    stop.set()
    thread.join()
    for connection in accepted:
        connection.close()
    server.close()


def test_an_unreachable_hub_ends_at_llmclis_own_bound_in_one_line(silent_hub) -> None:
    """A Hub that takes the connection and never answers: llmcli gives up at its own bound
    (HUB_TIMEOUT_S, named in the message) with one line, rather than waiting on the network.
    How long that takes is measured by scripts/bench_hub_timeout.py, not asserted here."""
    from llmcli.models.resolve import HUB_TIMEOUT_S

    url, connections = silent_hub
    proc = run_cli(
        "generate", "-m", "some-org/some-model", "hi", env={"HF_ENDPOINT": url, "HF_HUB_OFFLINE": "0"}
    )
    err = proc.stderr.decode()
    assert proc.returncode == EXIT_FAILURE
    assert err.count("\n") == 1 and "some-org/some-model" in err, err
    assert f"{url} did not answer within {HUB_TIMEOUT_S:.0f} s" in err, err
    assert connections, "the request never reached the silent hub: the bound was not what ended it"


def test_default_model_is_the_demo_when_installed() -> None:
    demo = demo_gguf_path()
    assert default_model_spec() == (str(demo) if demo else DEFAULT_HUB_MODEL)
