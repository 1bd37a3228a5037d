"""`llmcli serve --kv-layout paged` on the CPU, end to end (a GPU server's default layout):
every generation's keys and values in blocks of one pool (engine/native/paged_slots.py),
through real clients (the official `openai` SDK) on 127.0.0.1, with a tiny fp32 model.

What it must keep: the slots layout's greedy tokens, concurrent requests among them; a system
prompt's blocks computed once for every request that starts with it, kept after its request
ended; with a pool too small for every request at once, each still completes with its tokens
(the newest preempted and brought back, none failing); and a layout it cannot honour refused
in one line.
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from llmcli.engine.conversation import build_messages, prompt_ids

from cli_helpers import PATIENCE_S, run_cli
from test_serve import Server, metric, served

# tiny_llama's keys and values (tests/tiny_models.py): 2 layers × 2 KV heads × 16 wide, fp32.
BLOCK_BYTES = 16 * 2 * 2 * 2 * 16 * 4
PROMPTS = [f"Question number {i}, asked at the same time" for i in range(4)]
PREEMPTIONS = "llmcli_preemptions_total"


@pytest.fixture(scope="module")
def paged(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory):
    yield from served(tiny_llama, tmp_path_factory.mktemp("runtime"), "--kv-layout", "paged")


@pytest.fixture(scope="module")
def small_pool(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory):
    """A pool of 12 blocks: a request of ~30 prompt tokens and 64 new ones takes 6 or 7."""
    yield from served(
        tiny_llama, tmp_path_factory.mktemp("runtime"), "--kv-layout", "paged",
        "--parallel", "4", "--kv-memory", str(12 * BLOCK_BYTES),
    )  # fmt: skip


def at_once(server: Server, prompts: list[str], max_tokens: int, **options: object) -> dict[str, str]:
    """Each prompt's greedy reply, the requests sent together (threads released at once)."""
    replies: dict[str, str] = {}
    ready = threading.Barrier(len(prompts))

    def ask(prompt: str) -> None:
        ready.wait(PATIENCE_S)
        reply = server.client().chat.completions.create(
            model="tiny", messages=build_messages(prompt), max_tokens=max_tokens, temperature=0, **options
        )
        replies[prompt] = reply.choices[0].message.content

    threads = [threading.Thread(target=ask, args=(prompt,)) for prompt in prompts]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(PATIENCE_S)
    return replies


def test_concurrent_requests_get_the_slots_layouts_tokens(paged: Server, tiny_llama_server: Server) -> None:
    # the defaults depend on the device and the model: the start says which it took
    assert "4 generations at once, their keys and values in paged blocks" in paged.said, paged.said
    assert "4 generations at once, their keys and values in contiguous slots" in tiny_llama_server.said
    """The CPU's default layout (slots) is the reference: fp32, greedy, the same requests at once."""
    assert at_once(paged, PROMPTS, 32) == at_once(tiny_llama_server, PROMPTS, 32)


def chats_of_one_system_prompt(tiny_llama: Path, *questions: str) -> tuple[list[list[dict]], int]:
    """A chat per question under one long system prompt, and the tokens their prompts share."""
    from transformers import AutoTokenizer

    from llmcli.engine.prefix import common_prefix_length

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    rules = {"role": "system", "content": " ".join(f"Rule {i}: be brief." for i in range(30))}
    chats = [[rules, {"role": "user", "content": question}] for question in questions]
    first, *others = [prompt_ids(tokenizer, chat) for chat in chats]
    return chats, min(common_prefix_length(first, ids) for ids in others)


def test_a_system_prompt_is_prefilled_once_and_kept_after_its_request(
    paged: Server, tiny_llama: Path
) -> None:
    """Two chats with one long system prompt, the second sent after the first ended (its slot
    let its blocks go): the second holds the system prompt's blocks again and prefills only its
    own tail (within the block where the two part), as its usage and /metrics say."""
    (first, second), shared = chats_of_one_system_prompt(tiny_llama, "Tell me a story.", "And a short one?")
    assert shared > 100
    client = paged.client()
    client.chat.completions.create(model="tiny", messages=first, max_tokens=8, temperature=0)
    cached_before = metric(paged, 'llmcli_tokens_total{kind="cached"}')
    reply = client.chat.completions.create(model="tiny", messages=second, max_tokens=8, temperature=0)
    cached = reply.usage.prompt_tokens_details.cached_tokens
    assert shared - 16 < cached <= shared
    assert reply.usage.prompt_tokens - cached < reply.usage.prompt_tokens - shared + 16  # its tail
    assert metric(paged, 'llmcli_tokens_total{kind="cached"}') - cached_before == cached


def test_a_pool_too_small_for_every_request_preempts_and_completes_them_all(
    small_pool: Server, tiny_llama_server: Server, tiny_llama: Path
) -> None:
    """Four requests of 64 tokens each (the end token never chosen) on a pool that holds two of
    them: sequences are preempted as blocks run out, and every request completes with the
    tokens it gets on the slots layout; none fails."""
    from transformers import AutoTokenizer

    never_ends = {str(AutoTokenizer.from_pretrained(tiny_llama).eos_token_id): -100}
    before = metric(small_pool, PREEMPTIONS)
    got = at_once(small_pool, PROMPTS, 64, logit_bias=never_ends)
    assert metric(small_pool, PREEMPTIONS) > before
    assert got == at_once(tiny_llama_server, PROMPTS, 64, logit_bias=never_ends)
    assert all(len(text) > 0 for text in got.values())


def serve_refusal(model: Path, tmp_path: Path, *options: str) -> str:
    """`llmcli serve` with `options`: it must exit 2 with one line on stderr, which is returned."""
    done = run_cli(
        "serve", "-m", str(model), "--port", "0", "--device", "cpu", *options,
        env={"XDG_RUNTIME_DIR": str(tmp_path)},
    )  # fmt: skip
    lines = done.stderr.decode().strip().splitlines()
    assert done.returncode == 2, done.stderr
    assert len(lines) == 1 and "Traceback" not in lines[0], lines
    return lines[0]


def test_a_bad_layout_is_refused_in_one_line(tiny_llama: Path, tmp_path: Path) -> None:
    assert "--kv-layout must be paged or slots" in serve_refusal(tiny_llama, tmp_path, "--kv-layout", "pages")
    done = run_cli("bench", "-m", str(tiny_llama), "--kv-layout", "paged")  # without --concurrency
    assert done.returncode == 2 and "--concurrency" in done.stderr.decode()


def test_a_model_or_engine_the_paged_pool_cannot_hold_is_refused_in_one_line(
    tiny_llama: Path, tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    from tiny_models import build_tiny_model

    line = serve_refusal(tiny_llama, tmp_path, "--kv-layout", "paged", "--engine", "transformers")
    assert "native engine" in line
    qwen3_5 = build_tiny_model(tmp_path_factory.mktemp("models") / "qwen3_5", "qwen3_5")
    line = serve_refusal(qwen3_5, tmp_path, "--kv-layout", "paged")
    assert "recurrent or shared-KV layers" in line


def test_bench_concurrency_measures_the_paged_step(tiny_llama: Path) -> None:
    """`bench --concurrency --kv-layout paged`: the sequences of one paged pool, stepped together
    by paged_slots.PagedSlots, each level beside one alone (what the GPU's streams rows run)."""
    import json

    proc = run_cli(
        "bench", "-m", str(tiny_llama), "--concurrency", "3", "--prompt-lengths", "20", "-n", "6",
        "--runs", "1", "--device", "cpu", "--json", "--kv-layout", "paged",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr.decode()
    report = json.loads(proc.stdout)
    assert report["kv_layout"] == "paged"
    levels = {level["sequences"]: level for level in report["levels"]}
    assert set(levels) == {1, 3} and levels[3]["kv_tokens"] == 3 * (20 + 6)
    assert report["single_stream_tok_s"] > 0 and levels[3]["aggregate_tok_s"] > 0
