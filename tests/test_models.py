"""`llmcli models …`, the config file and its precedence, aliases, completion, --version.

Every test runs the CLI against a Hugging Face cache and config directory made for it: nothing
touches the real home directory.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path

import pytest

from llmcli.models.resolve import demo_gguf_path

from cli_helpers import PATIENCE_S, run_cli
from tiny_models import put_in_hf_cache

REPO = "tiny-org/tiny-llama"


@pytest.fixture
def home(tiny_llama: Path, tmp_path: Path) -> dict[str, str]:
    """An environment with its own HF cache (holding the tiny model) and config file location."""
    hf_home = tmp_path / "hf"
    snapshot = put_in_hf_cache(tiny_llama, hf_home, REPO)
    # Make the cached generation_config carry sampling values, to see that layer too.
    generation = snapshot / "generation_config.json"
    values = json.loads(generation.read_text()) | {"max_new_tokens": 7, "repetition_penalty": 1.5}
    generation.unlink()
    generation.write_text(json.dumps(values))
    return {
        "HF_HOME": str(hf_home),
        "XDG_CONFIG_HOME": str(tmp_path / "config"),
        "XDG_CACHE_HOME": os.environ["XDG_CACHE_HOME"],  # the session's: the demo conversion is there
    }


def write_config(env: dict[str, str], text: str) -> Path:
    path = Path(env["XDG_CONFIG_HOME"]) / "llmcli" / "config.toml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def test_models_list_shows_the_cache(home: dict[str, str]) -> None:
    proc = run_cli("models", "list", "--json", env=home)
    assert proc.returncode == 0, proc.stderr.decode()
    entries = {e["name"]: e for e in json.loads(proc.stdout)}
    tiny = entries[REPO]
    assert tiny["source"] == "hub" and tiny["revision"] == "0123456789ab"
    assert tiny["architecture"] == "LlamaForCausalLM" and tiny["context_length"] == 1024
    assert tiny["chat_template"] is True and tiny["size_bytes"] > 0
    from safetensors import safe_open

    with safe_open(Path(tiny["path"]) / "model.safetensors", "pt") as weights:
        counts = [math.prod(weights.get_slice(name).get_shape()) for name in weights.keys()]  # noqa: SIM118
    assert tiny["parameters"] == sum(counts)
    table = run_cli("models", "list", env=home).stdout.decode()
    assert table.splitlines()[0].split()[:4] == ["NAME", "REVISION", "ON", "DISK"] and REPO in table


def test_models_show_summarizes_the_model(home: dict[str, str]) -> None:
    proc = run_cli("models", "show", REPO, "--json", env=home)
    assert proc.returncode == 0, proc.stderr.decode()
    summary = json.loads(proc.stdout)
    memory = summary["memory_bytes"]
    assert memory["int4"] < memory["int8"] < memory["bf16"]
    assert summary["layers"] == 2 and summary["kv_heads"] == 2
    assert (
        summary["kv_bytes_per_token_bf16"] == 2 * 2 * 16 * 2 * 2
    )  # layers × KV heads × head dim × K,V × bytes
    assert summary["generation_defaults"]["max_new_tokens"] == 7
    assert "<|im_start|>" in summary["chat_template_text"]
    assert "not in the local caches" in run_cli("models", "show", "no/such-model", env=home).stderr.decode()


def test_models_rm_asks_then_deletes(home: dict[str, str]) -> None:
    refused = run_cli("models", "rm", REPO, env=home)  # stdin is not a terminal: no one to ask
    assert refused.returncode == 2 and "--yes" in refused.stderr.decode()
    removed = run_cli("models", "rm", REPO, "--yes", env=home)
    assert removed.returncode == 0, removed.stderr.decode()
    assert "freed" in removed.stdout.decode()
    assert REPO not in run_cli("models", "list", env=home).stdout.decode()
    missing = run_cli("models", "rm", REPO, "--yes", env=home)
    assert missing.returncode == 1 and "no model named" in missing.stderr.decode()


def test_models_pull_offline_is_a_clear_error(home: dict[str, str]) -> None:
    proc = run_cli("models", "pull", "someone/not-cached", env=home)
    assert proc.returncode == 1
    assert proc.stderr.decode().count("\n") == 1 and "HF_HUB_OFFLINE" in proc.stderr.decode()
    cached = run_cli("models", "pull", REPO, env=home)  # already here: no network needed
    assert cached.returncode == 0 and "snapshots" in cached.stdout.decode()


@pytest.mark.demo
@pytest.mark.skipif(demo_gguf_path() is None, reason="the demo model is not installed")
def test_models_import_names_a_gguf_file(home: dict[str, str], tmp_path: Path) -> None:
    gguf = tmp_path / demo_gguf_path().name
    # A copy: the same name and content, so the session's conversion is found (name + fingerprint).
    shutil.copy(demo_gguf_path(), gguf)
    proc = run_cli("models", "import", str(gguf), "--name", "smol-demo", env=home, timeout=PATIENCE_S)
    assert proc.returncode == 0, proc.stderr.decode()
    assert "smol-demo" in run_cli("models", "list", env=home).stdout.decode()
    answer = run_cli(
        "generate", "-m", "smol-demo", "-t", "0", "-n", "12", "Name the capital of France.", env=home
    )
    assert answer.returncode == 0 and "Paris" in answer.stdout.decode()


def test_precedence_with_every_layer(home: dict[str, str]) -> None:
    write_config(
        home,
        f"""
model = "tiny"

[defaults]
temperature = 0.1
top_k = 11
top_p = 0.9
repetition_penalty = 1.1

[aliases]
tiny = "{REPO}"

[models."{REPO}"]
temperature = 0.2
top_p = 0.5
min_p = 0.01
""",
    )
    env = {**home, "LLMCLI_TEMPERATURE": "0.3", "LLMCLI_MIN_P": "0.07"}
    proc = run_cli("generate", "--json", "-t", "0.4", "--seed", "1", "hi", env=env)  # no -m: config's model
    assert proc.returncode == 0, proc.stderr.decode()
    record = json.loads(proc.stdout)
    assert record["model"] == REPO
    assert record["sampling"] | {"stop": []} == {
        "temperature": 0.4,  # flag, over env 0.3, the model's 0.2 and the defaults' 0.1
        "min_p": 0.07,  # env, over the model's 0.01
        "top_p": 0.5,  # the model's section, over the defaults' 0.9
        "top_k": 11,  # [defaults]
        "repetition_penalty": 1.1,  # [defaults], over generation_config.json's 1.5
        "presence_penalty": 0.0,  # built-in
        "frequency_penalty": 0.0,
        "max_new_tokens": 7,  # generation_config.json
        "seed": 1,
        "stop": [],
    }
    shown = json.loads(run_cli("config", "show", "--json", env=env).stdout)
    sources = {key: entry["source"] for key, entry in shown.items()}
    assert sources["temperature"] == "env" and sources["min_p"] == "env"
    assert sources["top_p"] == f'config [models."{REPO}"]' and sources["top_k"] == "config [defaults]"
    assert sources["max_new_tokens"] == "generation_config.json" and sources["seed"] == "built-in"
    assert shown["model"]["value"] == REPO and "config" in sources["model"]


def test_config_show_lists_speculative_decoding_and_its_sources(home: dict[str, str]) -> None:
    def shown(env: dict[str, str]) -> dict[str, tuple[object, str]]:
        proc = run_cli("config", "show", "--json", env=env)
        assert proc.returncode == 0, proc.stderr.decode()
        return {key: (entry["value"], entry["source"]) for key, entry in json.loads(proc.stdout).items()}

    plain = shown(home)
    assert plain["speculative"] == ("off", "built-in") and plain["draft_tokens"] == ("adaptive", "built-in")
    write_config(home, '[defaults]\ndraft_model = "self"\n')
    drafting = shown({**home, "LLMCLI_DRAFT_TOKENS": "5"})
    # Naming a draft model turns drafting on: the method comes from where the model was named.
    assert drafting["speculative"] == ("draft", "config [defaults]")
    assert drafting["draft_model"] == ("self", "config [defaults]")
    assert drafting["draft_tokens"] == (5, "env")


def test_broken_config_names_file_and_line(home: dict[str, str]) -> None:
    path = write_config(home, 'model = "x"\n[defaults]\ntemperature = = 0.5\n')
    proc = run_cli("generate", "hi", env=home)
    err = proc.stderr.decode()
    assert proc.returncode == 2 and str(path) in err and "line 3" in err
    write_config(home, "[defaults]\ntemprature = 0.5\n")
    typo = run_cli("generate", "hi", env=home).stderr.decode()
    assert "unknown setting 'temprature'" in typo
    assert run_cli("config", "path", env=home).stdout.decode().strip() == str(path)


def test_completion_lists_cached_models_and_aliases(home: dict[str, str]) -> None:
    write_config(home, f'[aliases]\ntiny = "{REPO}"\n')
    env = {**home, "_LLMCLI_COMPLETE": "complete_bash", "COMP_WORDS": "llmcli chat -m ", "COMP_CWORD": "3"}
    proc = run_cli(env=env)
    words = proc.stdout.decode().split()
    assert REPO in words and "tiny" in words
    env["COMP_WORDS"] = "llmcli chat -m ti"
    assert run_cli(env=env).stdout.decode().split() == ["tiny", REPO]


def test_version_names_libraries_and_device() -> None:
    out = run_cli("--version").stdout.decode()
    for name in ("llmcli", "torch", "transformers", "bitsandbytes"):
        assert name in out
    assert "device CPU only" in out or "device CUDA" in out
