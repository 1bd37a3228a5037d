"""The prompt cache on disk (engine/disk_prefix.py): a prompt's state written by one engine (or
process) is resumed by the next, and its reply equals the reply prefilled whole (fp32, a Llama
and a hybrid Gated DeltaNet model); nothing is resumed across models, load settings or a changed
model file; an entry truncated, tampered with, of another format, or not safely ours is refused
in one line, removed and recomputed; the folder stays within its size, least recently used
first; a write that fails stops the writing in one line and the answer goes on."""

from __future__ import annotations

import json
import os
import resource
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from llmcli.config.settings import LoadSettings, SamplingParams
from llmcli.engine.disk_prefix import INDEX_FILE, MIN_DISK_TOKENS, DiskTier
from llmcli.engine.loop import Engine
from llmcli.engine.native.saved_tensors import disk_tier_for

from cli_helpers import LLMCLI, PATIENCE_S, run_cli
from tiny_models import build_tiny_model

REPLY = SamplingParams(temperature=0.0, max_new_tokens=12)
VOCAB = 400  # the tiny tokenizers' trained tokens
ATOL = 1e-4


@pytest.fixture(scope="module")
def qwen35(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("models") / "qwen3_5", "qwen3_5")


@pytest.fixture(params=["llama", "qwen3_5"])
def model(request: pytest.FixtureRequest, tiny_llama: Path, qwen35: Path) -> Path:
    return {"llama": tiny_llama, "qwen3_5": qwen35}[request.param]


def load(folder: Path, **settings: Any) -> Any:
    from llmcli.frontends.loading import load_with_feedback

    return load_with_feedback(str(folder), LoadSettings(device="cpu", threads=1, **settings), lean=True)


def ids(count: int, seed: int) -> list[int]:
    return torch.randint(0, VOCAB, (count,), generator=torch.Generator().manual_seed(seed)).tolist()


DOCUMENT = ids(600, 0)  # past a recurrent checkpoint (every 512 tokens)
FIRST, SECOND = DOCUMENT + ids(20, 1), DOCUMENT + ids(20, 2)


class Process:
    """An engine with a disk tier of its own over `folder`: what a new process would have."""

    def __init__(self, loaded: Any, folder: Path, budget: int = 1 << 30) -> None:
        self.loaded = loaded
        self.warnings: list[str] = []
        self.engine = Engine.for_loaded(loaded)
        facts = {"model": loaded.fingerprint, "dtype": loaded.dtype_name, "quant": loaded.quant}
        tier = disk_tier_for(self.engine.backend, facts, budget, folder, self.warnings.append)
        assert tier is not None
        self.tier: DiskTier = tier
        self.engine.prefixes.disk = tier

    def answer(self, prompt: list[int]) -> tuple[list[int], torch.Tensor, Any]:
        """The greedy reply's tokens, the prompt's logits, and the stats; written before it returns."""
        generation = self.engine.generate(prompt, REPLY, self.loaded.tokenizer)
        for _ in generation:
            pass
        self.tier.flush()
        return list(generation.result.token_ids), generation.prefill_logits, generation.result.stats


def fresh(loaded: Any, prompt: list[int]) -> tuple[list[int], torch.Tensor]:
    """The reply with the whole prompt prefilled, no cache anywhere."""
    generation = Engine.for_loaded(loaded).generate(prompt, REPLY, loaded.tokenizer)
    for _ in generation:
        pass
    return list(generation.result.token_ids), generation.prefill_logits


def greedy(model: Path, *more: str) -> list[str]:
    """`llmcli generate`'s arguments for a short greedy reply from `model` on the CPU."""
    return ["generate", "-m", str(model), "-t", "0", "-n", "8", "--device", "cpu", *more]


def entries(folder: Path) -> list[Path]:
    return sorted(folder.glob("*.safetensors"))


def test_a_disk_hit_replies_as_the_prompt_prefilled_whole(model: Path, tmp_path: Path) -> None:
    loaded = load(model, dtype="fp32")
    Process(loaded, tmp_path).answer(FIRST)
    assert len(entries(tmp_path)) == 1
    later = Process(loaded, tmp_path)
    tokens, logits, stats = later.answer(SECOND)
    assert stats.cached_from == "disk" and stats.cached_tokens >= MIN_DISK_TOKENS
    assert later.tier.reads == 1 and not later.warnings
    expected_tokens, expected_logits = fresh(loaded, SECOND)
    assert tokens == expected_tokens
    torch.testing.assert_close(logits, expected_logits, atol=ATOL, rtol=0)


def test_a_second_generate_process_reuses_the_first_ones_document(tiny_llama: Path, tmp_path: Path) -> None:
    document = " ".join(f"line {i} of the report says {i * 7 % 13}." for i in range(28)).encode()
    env = {"XDG_CACHE_HOME": str(tmp_path), "LLMCLI_PROMPT_CACHE_SIZE": "1GiB"}

    def generate(question: str, **more: str) -> dict[str, Any]:
        proc = run_cli(*greedy(tiny_llama, "--json", question), stdin=document, env={**env, **more})
        assert proc.returncode == 0, proc.stderr.decode()
        assert not proc.stderr.strip(), proc.stderr.decode()
        return json.loads(proc.stdout)

    first = generate("What is the first line?")
    assert first["cached_tokens"] == 0 and first["cached_from"] is None
    second = generate("What is the last line?")
    assert second["cached_from"] == "disk" and second["cached_tokens"] > MIN_DISK_TOKENS
    assert second["prompt_tokens"] - second["cached_tokens"] < 20  # the question and the template's end
    uncached = generate("What is the last line?", LLMCLI_PROMPT_CACHE_SIZE="0")
    assert uncached["cached_tokens"] == 0 and uncached["text"] == second["text"]


@pytest.mark.parametrize(
    "other",
    [
        pytest.param(lambda folder, tmp: (tmp / "other", {"dtype": "fp32"}), id="another-model"),
        pytest.param(lambda folder, tmp: (folder, {"dtype": "bf16"}), id="another-dtype"),
        pytest.param(lambda folder, tmp: (folder, {"dtype": "fp32", "quant": "int8"}), id="another-quant"),
        pytest.param(lambda folder, tmp: (folder, {"dtype": "fp32", "touch": True}), id="a-changed-file"),
    ],
)
def test_nothing_is_reused_across_models_settings_or_a_changed_file(
    other: Callable[[Path, Path], tuple[Path, dict[str, Any]]], tiny_llama: Path, tmp_path: Path
) -> None:
    folder = tmp_path / "model"
    shutil.copytree(tiny_llama, folder)
    build_tiny_model(tmp_path / "other", "llama", seed=1)
    cache = tmp_path / "cache"
    Process(load(folder, dtype="fp32"), cache).answer(FIRST)
    assert len(entries(cache)) == 1
    where, settings = other(folder, tmp_path)
    if settings.pop("touch", False):  # rewritten as it was, a moment later: another file
        weights = folder / "model.safetensors"
        weights.write_bytes(weights.read_bytes())
        os.utime(weights, ns=(weights.stat().st_atime_ns, weights.stat().st_mtime_ns + 10**9))
    later = Process(load(where, **settings), cache)
    assert later.tier.longest(SECOND) == (None, 0)
    _, _, stats = later.answer(SECOND)
    assert stats.cached_tokens == 0 and later.tier.reads == 0


def _rewrite_header(path: Path, change: Callable[[dict[str, Any]], None]) -> None:
    """The entry written again with its llmcli header changed (`change`), its tensors as they were."""
    import safetensors.torch
    from safetensors import safe_open

    with safe_open(str(path), "pt") as handle:
        meta = json.loads(handle.metadata()["llmcli"])
        tensors = {name: handle.get_tensor(name) for name in handle.keys()}  # noqa: SIM118
    change(meta)
    path.write_bytes(safetensors.torch.save(tensors, metadata={"llmcli": json.dumps(meta)}))
    index = path.parent / INDEX_FILE
    data = json.loads(index.read_text())
    data["entries"][path.name]["bytes"] = path.stat().st_size  # the index agrees: the file is what is checked
    index.write_text(json.dumps(data))


def _tampered_ids(meta: dict[str, Any]) -> None:
    from llmcli.engine.disk_prefix import _packed, _unpacked

    held = _unpacked(meta["ids"])
    held[5] = (held[5] + 1) % VOCAB
    meta["ids"] = _packed(held)


def _flip_last_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x40
    path.write_bytes(bytes(data))


BAD_ENTRIES: dict[str, Callable[[Path], None]] = {
    "truncated": lambda path: os.truncate(path, path.stat().st_size - 100),
    "tampered-tokens": lambda path: _rewrite_header(path, _tampered_ids),
    "tampered-tensors": _flip_last_byte,
    "another-format": lambda path: _rewrite_header(path, lambda meta: meta.update(format=99)),
    "another-user": lambda path: os.chown(path, 4242, -1),
    "group-writable": lambda path: os.chmod(path, 0o620),
    "other-writable": lambda path: os.chmod(path, 0o602),
}


@pytest.mark.parametrize("spoil", BAD_ENTRIES.values(), ids=BAD_ENTRIES.keys())
def test_a_bad_entry_is_refused_removed_and_recomputed(
    spoil: Callable[[Path], None], qwen35: Path, tmp_path: Path
) -> None:
    loaded = load(qwen35, dtype="fp32")
    Process(loaded, tmp_path).answer(FIRST)
    (entry,) = entries(tmp_path)
    spoil(entry)
    later = Process(loaded, tmp_path)
    tokens, logits, stats = later.answer(SECOND)
    assert len(later.warnings) == 1 and "refused" in later.warnings[0], later.warnings
    assert stats.cached_from != "disk" and later.tier.reads == 0
    assert entry.name not in json.loads((tmp_path / INDEX_FILE).read_text())["entries"]
    expected_tokens, expected_logits = fresh(loaded, SECOND)
    assert tokens == expected_tokens
    torch.testing.assert_close(logits, expected_logits, atol=ATOL, rtol=0)
    assert not entry.exists()


def test_the_folder_stays_within_its_size_least_recently_used_first(tiny_llama: Path, tmp_path: Path) -> None:
    loaded = load(tiny_llama, dtype="fp32")
    prompts = [ids(300, 100 + n) + ids(5, 1) for n in range(12)]
    Process(loaded, tmp_path / "probe").answer(prompts[0])
    (one,) = entries(tmp_path / "probe")
    budget = int(one.stat().st_size * 3.5)  # three entries of this size fit, not four
    cache = tmp_path / "cache"
    process = Process(loaded, cache, budget)
    for n, prompt in enumerate(prompts):
        process.answer(prompt)
        assert sum(path.stat().st_size for path in entries(cache)) <= budget
        if n == 2:  # the first prompt's document asked about again: used last, so it stays
            _, _, stats = Process(loaded, cache, budget).answer(prompts[0][:-5] + ids(5, 2))
            assert stats.cached_from == "disk"
            assert Process(loaded, cache, budget).tier.longest(prompts[0])[0] is not None
            assert Process(loaded, cache, budget).tier.longest(prompts[1])[0] is None  # the least recent
    index = json.loads((cache / INDEX_FILE).read_text())["entries"]
    assert {path.name for path in entries(cache)} == set(index) and len(index) == 3
    latest, shared = Process(loaded, cache, budget).tier.longest(prompts[-1])
    assert latest is not None and shared == len(prompts[-1])


def _limited_file_size() -> None:
    # No file written may grow past 64 KiB, as on a full disk: the write fails with EFBIG
    # (Python ignores SIGXFSZ, so the process is not killed).
    resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, 64 * 1024))


def test_a_cache_that_cannot_be_written_says_so_once_and_the_answer_goes_on(
    tiny_llama: Path, tmp_path: Path
) -> None:
    document = " ".join(f"line {i} of the report." for i in range(60)).encode()
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path), "LLMCLI_PROMPT_CACHE_SIZE": "1GiB"}
    args = [*LLMCLI, *greedy(tiny_llama, "Which line?")]
    limited = subprocess.run(
        args, input=document, capture_output=True, env=env, timeout=PATIENCE_S, preexec_fn=_limited_file_size
    )
    assert limited.returncode == 0, limited.stderr.decode()
    lines = limited.stderr.decode().strip().splitlines()
    assert len(lines) == 1 and "cannot write" in lines[0] and "answers go on" in lines[0], lines
    assert not list((tmp_path / "llmcli" / "prompts").glob("*.safetensors"))
    plain = run_cli(*args[len(LLMCLI) :], stdin=document, env={"LLMCLI_PROMPT_CACHE_SIZE": "0"})
    assert limited.stdout == plain.stdout and plain.stdout.strip()


def test_a_size_that_is_not_one_is_refused_in_one_line(tiny_llama: Path) -> None:
    from cli_helpers import one_error_line

    proc = run_cli("generate", "-m", str(tiny_llama), "--prompt-cache-size", "lots", "hi")
    assert "--prompt-cache-size" in one_error_line(proc, 2)


def test_python_ignores_sigxfsz_so_a_file_size_limit_is_an_error_not_a_kill() -> None:
    import signal

    assert sys.platform != "linux" or signal.getsignal(signal.SIGXFSZ) == signal.SIG_IGN


def test_a_restarted_server_resumes_a_known_conversation(
    tiny_llama: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from test_serve import assert_access_log_only, start_server

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setenv("LLMCLI_PROMPT_CACHE_SIZE", "1GiB")
    system = "You answer questions about the report below, briefly. " + "The report has many lines. " * 40
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "What is it about?"}]

    def turn(messages: list[dict[str, str]]) -> dict[str, Any]:
        server = start_server(tiny_llama, tmp_path / "runtime")
        body = {"model": "tiny", "messages": messages, "max_tokens": 8, "temperature": 0}
        status, answer = server.raw("POST", "/v1/chat/completions", json.dumps(body).encode())
        server.process.send_signal(signal.SIGTERM)  # as `llmcli stop` does
        assert server.process.wait(timeout=PATIENCE_S) == 0
        assert_access_log_only(server.process.stderr.read())
        assert status == 200, answer
        return answer

    first = turn(messages)
    assert first["timings"]["cached_tokens"] == 0
    reply = first["choices"][0]["message"]["content"]
    second = turn([*messages, {"role": "assistant", "content": reply}, {"role": "user", "content": "And?"}])
    usage = second["usage"]
    assert second["timings"]["cached_from"] == "disk"
    assert usage["prompt_tokens_details"]["cached_tokens"] >= 0.9 * usage["prompt_tokens"]


def test_a_new_chat_session_resumes_the_last_ones_system_prompt(tiny_llama: Path, tmp_path: Path) -> None:
    env = {"XDG_CACHE_HOME": str(tmp_path), "LLMCLI_PROMPT_CACHE_SIZE": "1GiB"}
    system = "You are terse and careful. " * 25
    args = ("chat", "-m", str(tiny_llama), "--device", "cpu", "-t", "0", "-n", "5", "-s", system, "--json")
    turns = []
    for message in (b"hello there\n", b"hello again\n"):
        proc = run_cli(*args, stdin=message, env=env)
        assert proc.returncode == 0, proc.stderr.decode()
        turns.append(json.loads(proc.stdout.splitlines()[0]))
    assert turns[0]["cached_tokens"] == 0
    assert turns[1]["cached_tokens"] >= MIN_DISK_TOKENS


def test_an_index_not_written_by_llmcli_is_read_as_empty(tiny_llama: Path, tmp_path: Path) -> None:
    loaded = load(tiny_llama, dtype="fp32")
    Process(loaded, tmp_path).answer(FIRST)
    index = tmp_path / INDEX_FILE
    data = json.loads(index.read_text())
    (name,) = data["entries"]
    data["entries"][name]["bytes"] = "many"
    outside = {"key": "x", "ids": "", "bytes": 1, "used": 0, "points": None}
    data["entries"]["../elsewhere.safetensors"] = outside
    index.write_text(json.dumps(data))
    later = Process(loaded, tmp_path)
    tokens, _, stats = later.answer(SECOND)
    assert stats.cached_tokens == 0 and not later.warnings
    assert tokens == fresh(loaded, SECOND)[0]
    index.write_text("[not json")
    assert Process(loaded, tmp_path).tier.longest(SECOND) == (None, 0)
