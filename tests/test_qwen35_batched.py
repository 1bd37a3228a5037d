"""Qwen3.5 (Gated DeltaNet layers beside gated attention) decoding several sequences in one step
on the native engine: each sequence's recurrent state comes from its own cache, the states run
as the rows of one, and every row is what its sequence gives alone — in one engine's step, and
through `llmcli serve --parallel 4` with requests joining while others decode (fp32, greedy)."""

from __future__ import annotations

import json
import signal
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import test_qwen35
from engines import engine_for
from test_qwen35 import ids

from cli_helpers import PATIENCE_S
from test_serve import Server, served, start_server, steps_of_several

# The tiny model and its native load, as test_qwen35's tests have them.
folder, loaded = test_qwen35.folder, test_qwen35.loaded

CONTEXT = 256
# A matrix product of B rows rounds each row within ~1e-6 of a product of one (fp32, this torch);
# through the layers that reaches ~4e-5 on the logits, under the 1e-4 the model keeps to
# transformers' reference. The greedy tokens are the same, as the tests check.
ATOL = 1e-4


@pytest.mark.parametrize("pooled", [False, True])
@torch.inference_mode()
def test_several_sequences_in_one_step_each_equal_it_alone(loaded, pooled: bool) -> None:
    """Three sequences (one past a chunk of the rule, 64) decoded together, the third joining
    after three steps and the second leaving after eight: every row's logits within ATOL of the
    same sequence decoded alone, step after step, and the greedy tokens the same. `pooled`:
    the caches are slots of one pool, the attention layers one masked call over them."""
    from llmcli.engine.native.backend import NativeBackend

    net = NativeBackend(loaded.model, CONTEXT).net
    pool = net.new_pool(CONTEXT) if pooled else None
    together = [NativeBackend(None, CONTEXT, net=net, pool=pool) for _ in range(3)]
    if pool is not None:  # the linear-attention layers hold no keys and values there
        assert pool.pooled == [block.attention is not None for block in net.blocks]
    alone = [NativeBackend(None, CONTEXT, net=net) for _ in range(3)]
    prompts = [ids(70, seed=20), ids(40, seed=21), ids(55, seed=22)]
    tokens: list[int] = []
    for step in range(12):
        while len(tokens) < (2 if step < 3 else 3):
            sequence = len(tokens)
            expected = alone[sequence].prefill(prompts[sequence])
            prefilled = together[sequence].prefill(prompts[sequence])
            torch.testing.assert_close(prefilled, expected, rtol=0, atol=1e-5)
            tokens.append(int(expected.argmax()))
        going = [s for s in range(len(tokens)) if not (s == 1 and step >= 8)]
        feed = torch.tensor([tokens[s] for s in going])
        rows = net.decode_sequences(feed, [together[s].cache for s in going])
        for row, sequence in enumerate(going):
            expected = alone[sequence].decode(torch.tensor([tokens[sequence]]))
            torch.testing.assert_close(rows[row : row + 1], expected, rtol=0, atol=ATOL)
            assert int(rows[row].argmax()) == int(expected.argmax())
            tokens[sequence] = int(expected.argmax())
    for mine, theirs in zip(together, alone, strict=True):
        assert mine.length == theirs.length


@torch.inference_mode()
def test_the_memory_of_sequences_at_once_counts_their_states(loaded) -> None:
    """Each sequence holds its DeltaNet layers' states beside its keys and values, whatever its
    length, and checkpoints of them: counted as large as they are held, and reserved by a
    server's slots, so a limit that holds two slots' keys and values but not both their states
    and checkpoints refuses the second generation."""
    from llmcli.engine.loop import Engine
    from llmcli.engine.native.backend import NativeBackend
    from llmcli.engine.native.recurrent_cache import MAX_CHECKPOINTS
    from llmcli.engine.scheduler import ComputeThread, Slots
    from llmcli.errors import KVMemoryFull

    backend = NativeBackend(loaded.model, CONTEXT)
    backend.prefill(ids(10, seed=30))
    held = sum(state.nbytes for state, _ in backend.cache.states.values())  # type: ignore[attr-defined]
    assert held == backend.net.state_bytes > 0
    apart = (1 + MAX_CHECKPOINTS) * held  # the states, and as many checkpoints as may be kept
    assert backend.kv_bytes_for(10) == backend.net.new_cache(CONTEXT).bytes_for(10) >= apart
    two_slots = backend.net.new_pool(CONTEXT).bytes_for(2, 256)  # the smallest bucket
    for limit, fits in ((two_slots + 2 * apart, True), (two_slots + 2 * apart - 1, False)):
        compute = ComputeThread()
        try:
            first = Engine(NativeBackend(None, CONTEXT, net=backend.net), frozenset(), CONTEXT)
            slots = Slots(first, 2, compute, kv_limit=limit)
            with compute.generation():
                slots.take(ids(10, seed=31), longest=100)
                if fits:
                    slots.take(ids(10, seed=32), longest=100)
                else:
                    with pytest.raises(KVMemoryFull, match="the KV memory is taken"):
                        slots.take(ids(10, seed=32), longest=100)
        finally:
            compute.shutdown()


# Through a server ------------------------------------------------------------------------------

MAX_TOKENS = 128


@pytest.fixture(scope="module")
def server(folder: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    yield from served(folder, tmp_path_factory.mktemp("runtime"), "--engine", "native", "--parallel", "4")


@pytest.fixture(scope="module")
def never_ends(loaded) -> dict[int, float]:
    """A bias that keeps the end-of-turn token from being chosen: every reply runs its whole
    max_tokens, so a request that started first is still decoding as the next ones join."""
    return {loaded.tokenizer.convert_tokens_to_ids("<|im_end|>"): -100.0}


@pytest.fixture(scope="module")
def alone(loaded, never_ends: dict[int, float]):
    """The reply a prompt gets alone, in this process (greedy, the same bias unless `ends`)."""
    from llmcli.config.settings import SamplingParams
    from llmcli.engine.conversation import build_messages, prompt_ids

    engine = engine_for(loaded, backend="native")

    def reply(text: str, ends: bool = False) -> str:
        bias = () if ends else tuple(never_ends.items())
        params = SamplingParams(temperature=0.0, max_new_tokens=MAX_TOKENS, logit_bias=bias)
        engine.reset()
        ids = prompt_ids(loaded.tokenizer, build_messages(text))
        return "".join(engine.generate(ids, params, loaded.tokenizer))

    return reply


def streamed(server: Server, prompt: str, bias: dict[int, float], decoding: threading.Event) -> str:
    """`prompt`'s reply, streamed (greedy, `bias`); `decoding` is set once its first token has
    come (or the reply ended without one): from then on it is decoding."""
    from llmcli.engine.conversation import build_messages

    text = ""
    stream = server.client().chat.completions.create(
        model="tiny", messages=build_messages(prompt), max_tokens=MAX_TOKENS, temperature=0,
        stream=True, logit_bias=bias,
    )  # fmt: skip
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            text += chunk.choices[0].delta.content
            decoding.set()
    decoding.set()
    return text


def one_after_another(server: Server, prompts: list[str], bias: dict[int, float]) -> dict[str, str]:
    """Each prompt's streamed reply, each request sent once the one before it is decoding."""
    got: dict[str, str] = {}
    decoding = [threading.Event() for _ in prompts]

    def ask(index: int) -> None:
        if index:
            decoding[index - 1].wait(timeout=PATIENCE_S)
        got[prompts[index]] = streamed(server, prompts[index], bias, decoding[index])

    threads = [threading.Thread(target=ask, args=(index,)) for index in range(len(prompts))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=PATIENCE_S)
    return got


def test_four_requests_joining_one_after_another_each_get_their_reply_alone(
    server: Server, alone, never_ends: dict[int, float]
) -> None:
    """Four streamed requests, each sent once the one before it has its first token (so it
    joins steps already running): decode steps ran for several sequences, and every reply is
    the one its prompt gets alone."""
    prompts = [f"Question number {i} about the sea" for i in range(4)]
    expected = {prompt: alone(prompt) for prompt in prompts}
    before = steps_of_several(server)
    assert one_after_another(server, prompts, never_ends) == expected
    assert steps_of_several(server) > before


def test_a_server_left_to_its_default_on_a_cpu_runs_several_at_once(
    folder: Path, tmp_path: Path, alone, never_ends: dict[int, float]
) -> None:
    """Without --parallel the native engine on a CPU runs several generations at once for this
    family too, as for the others (it ran one at a time before its states could be stepped
    together)."""
    prompts = ["Left to its default", "Two at once"]
    running = start_server(folder, tmp_path, "--engine", "native")
    try:
        expected = {prompt: alone(prompt) for prompt in prompts}
        assert one_after_another(running, prompts, never_ends) == expected
        assert steps_of_several(running) > 0
    finally:
        running.process.send_signal(signal.SIGTERM)
        assert running.process.wait(timeout=PATIENCE_S) == 0


def test_n_choices_of_one_request_run_together_each_the_reply_alone(
    server: Server, alone, never_ends: dict[int, float]
) -> None:
    """A request's n greedy choices are n generations at once over the one prompt: each the
    reply alone. The prompt runs once per choice (a recurrent state is not copied between
    sequences yet), and the steps ran for several sequences."""
    from llmcli.engine.conversation import build_messages

    before = steps_of_several(server)
    text = "One question asked three times"
    reply = server.client().chat.completions.create(
        model="tiny", messages=build_messages(text), max_tokens=MAX_TOKENS, temperature=0, n=3,
        logit_bias=never_ends,
    )  # fmt: skip
    assert [choice.message.content for choice in reply.choices] == [alone(text)] * 3
    assert reply.usage.completion_tokens == 3 * MAX_TOKENS
    assert steps_of_several(server) > before


def test_a_speculated_request_beside_a_running_one_gets_its_reply_alone(
    server: Server, alone, never_ends: dict[int, float]
) -> None:
    """Lookup speculation checks its drafts one sequence at a time (plans.PerRowCheck), in the
    pooled cache of a server running others: sent once a long plain request is decoding, its
    reply is the one it gets alone, drafts checked and reported, and the plain one's too."""
    from llmcli.engine.conversation import build_messages

    repeating = "the cat sat on the mat, the cat sat on the mat, the cat sat on the"
    plain, decoding, got = "A long answer, please", threading.Event(), {}

    def ask_plain() -> None:
        got[plain] = streamed(server, plain, never_ends, decoding)

    thread = threading.Thread(target=ask_plain)
    thread.start()
    decoding.wait(timeout=PATIENCE_S)
    messages = build_messages(repeating)
    # Long enough for the random model's reply to repeat a pair of tokens (the lookup's draft).
    body = {"messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0, "speculative": "lookup"}
    status, reply = server.raw("POST", "/v1/chat/completions", json.dumps(body).encode())
    thread.join(timeout=PATIENCE_S)
    assert status == 200 and reply["choices"][0]["message"]["content"] == alone(repeating, ends=True)
    speculative = reply["timings"]["speculative"]
    assert speculative["method"] == "lookup" and speculative["drafted"] > 0, speculative
    assert got == {plain: alone(plain)}


def test_generate_batch_steps_the_prompts_together_each_as_alone(folder: Path, tmp_path: Path) -> None:
    """`generate --batch` on the native engine: the prompts decoded in shared steps, each reply
    the one `generate` gives that prompt alone."""
    from cli_helpers import run_cli

    prompts = ["Hello there", "The capital of France is", "Once upon a time"]
    (tmp_path / "prompts.txt").write_text("\n".join(prompts) + "\n")
    args = ["generate", "-m", str(folder), "--engine", "native", "-t", "0", "-n", "12", "--json"]
    batch = run_cli(*args, "--batch", str(tmp_path / "prompts.txt"))
    assert batch.returncode == 0, batch.stderr.decode()
    together = [json.loads(line)["text"] for line in batch.stdout.decode().splitlines()]
    assert together == [json.loads(run_cli(*args, prompt).stdout)["text"] for prompt in prompts]
