"""`llmcli bench --speculative`: decode speed with speculation beside the same model without it,
and what one check pass of K drafted tokens costs against a decode step.

The end-to-end rows generate the same prompt twice per run, once per engine (the runs
interleaved), and say whether the tokens were the same. Their speed-up depends on the text
the model writes, so it means something with real weights only; with random weights
(--config … --random-weights) the check-cost table is the figure that carries over: it says
how many drafted tokens one pass can check before it costs more than the tokens it saves.

Random weights write text that never repeats, so a lookup drafts nothing on it. To measure
what speculation gains where the text does repeat (a copy-heavy prompt) on such a model, the
replay rows draft the plain run's own tokens (`ReplayDrafter`), every one right or one in a
few wrong: as free and as right as a lookup on a reply that copies its prompt, through the
same check passes, graphs and draft-length rule.
"""

from __future__ import annotations

import random
import statistics
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from llmcli.config.settings import SamplingParams
from llmcli.engine.bench import interleaved_medians, prompt_of
from llmcli.engine.loop import Engine
from llmcli.models.load import LoadedModel

CHECK_LENGTHS = (2, 4, 8, 16)
# Replay rows: about one drafted token in this many is wrong (0: none), as lookups on copied text are.
REPLAY_WRONG_EVERY = (0, 10, 4)


@dataclass
class SpeculativeRow:
    task: str
    tokens: int
    off_tok_s: float
    on_tok_s: float
    drafted: int
    accepted: int
    same_tokens: bool

    @property
    def speedup(self) -> float:
        return self.on_tok_s / self.off_tok_s if self.off_tok_s else 0.0


@dataclass
class SpeculativeBenchReport:
    model: str
    device: str
    dtype: str
    quant: str
    engine: str
    graphs: bool
    method: str
    draft: str | None
    runs: int
    new_tokens: int
    random_weights: bool
    context: int  # tokens cached before the check passes are timed
    int4_cuda_kernel: str | None = None  # which int4 kernel a CUDA int4 model ran (int4_cuda.py)
    decode_step_s: float = 0.0
    check_s: dict[int, float] = field(default_factory=dict)  # drafted tokens checked → seconds
    rows: list[SpeculativeRow] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)  # tasks whose prompt does not fit the context

    def break_even(self, count: int) -> float:
        """The acceptance per drafted token at which checking `count` tokens (count − 1 drafts and
        the model's own) makes as many tokens a second as decode steps: below it drafts lose."""
        return break_even_acceptance(count - 1, self.check_s[count] / self.decode_step_s)

    def as_dict(self) -> dict[str, Any]:
        record = asdict(self)
        record["check_s"] = {str(k): v for k, v in self.check_s.items()}
        record["break_even"] = {str(k): self.break_even(k) for k in self.check_s}
        for row, out in zip(self.rows, record["rows"], strict=True):
            out["speedup"] = row.speedup
        return record


def tasks_for(
    loaded: LoadedModel, prompt_length: int, tasks: list[tuple[str, str]]
) -> list[tuple[str, list[int]]]:
    """The tasks (label, user message) through the model's template; a random prompt when
    there is no tokenizer (random weights)."""
    if loaded.tokenizer is None:
        vocab = loaded.model.config.get_text_config().vocab_size
        return [(f"random prompt ({prompt_length} tokens)", prompt_of(prompt_length, vocab))]
    from llmcli.engine.conversation import build_messages, prompt_ids

    return [(label, prompt_ids(loaded.tokenizer, build_messages(text))) for label, text in tasks]


def _generate(engine: Engine, ids: list[int], params: SamplingParams, tokenizer: Any) -> Any:
    engine.reset()
    return engine.complete(ids, params, tokenizer)


def compare(
    plain: Engine, speculating: Engine, ids: list[int], new_tokens: int, runs: int, tokenizer: Any
) -> tuple[float, float, Any, Any]:
    """Median decode tok/s of each engine on the same greedy prompt, the runs interleaved."""
    params = SamplingParams(temperature=0.0, max_new_tokens=new_tokens)
    _generate(plain, ids, params, tokenizer)  # warm-up: kernels, graphs, the allocator
    _generate(speculating, ids, params, tokenizer)
    off: list[float] = []
    on: list[float] = []
    for _ in range(runs):
        off_result = _generate(plain, ids, params, tokenizer)
        on_result = _generate(speculating, ids, params, tokenizer)
        off.append(off_result.stats.decode_tok_s)
        on.append(on_result.stats.decode_tok_s)
    return statistics.median(off), statistics.median(on), off_result, on_result


def check_costs(engine: Engine, context: list[int], runs: int) -> tuple[float, dict[int, float]]:
    """Seconds of one decode step and of one check pass of K tokens, after `context` is cached;
    the cache is cropped back after each, as the loop does after a rejection."""
    backend = engine.backend
    engine.reset()
    engine.prefill(context)
    base = backend.length
    token = torch.tensor([context[-1]], device=engine.device)

    def step() -> None:
        backend.decode(token)
        backend.crop(base)

    def check(count: int) -> None:
        backend.score(context[:count])
        backend.crop(base)

    passes: dict[str, Any] = {"1": step}
    passes |= {str(k): lambda k=k: check(k) for k in CHECK_LENGTHS}
    medians = interleaved_medians(passes, max(runs, 5), engine.device)
    engine.reset()
    return medians["1"], {k: medians[str(k)] for k in CHECK_LENGTHS}


def _int4_cuda_kernel(loaded: LoadedModel) -> str | None:
    if loaded.device.type != "cuda" or not loaded.quant.startswith("int4"):
        return None
    from llmcli.models.int4_cuda import chosen_kernel

    return chosen_kernel()


def _row(task: str, off: float, on: float, off_result: Any, on_result: Any) -> SpeculativeRow:
    drafts = on_result.stats.speculative
    return SpeculativeRow(
        task=task,
        tokens=len(on_result.token_ids),
        off_tok_s=off,
        on_tok_s=on,
        drafted=drafts.drafted if drafts else 0,
        accepted=drafts.accepted if drafts else 0,
        same_tokens=on_result.token_ids == off_result.token_ids,
    )


def _replay_rows(
    loaded: LoadedModel,
    plain: Engine,
    speculating: Engine,
    ids: list[int],
    budget: int,
    runs: int,
    reference: list[int],
) -> list[SpeculativeRow]:
    """The same prompt with drafts replayed from the plain run's tokens (ReplayDrafter), under
    the draft-length rule the speculating engine was given."""
    from llmcli.engine.speculative import Speculation
    from llmcli.engine.speculative.schedule import DraftLength

    asked = speculating.speculation
    assert asked is not None
    vocab = loaded.model.config.get_text_config().vocab_size
    rows = []
    try:
        for wrong_every in REPLAY_WRONG_EVERY:
            drafter = ReplayDrafter(len(ids), reference, wrong_every, vocab)
            speculating.speculation = Speculation(drafter, DraftLength(asked.length.fixed))
            wrong = f"1 in {wrong_every} wrong" if wrong_every else "all right"
            task = f"replay: the plain run's tokens, {wrong} (copy-heavy stand-in)"
            rows.append(_row(task, *compare(plain, speculating, ids, budget, runs, loaded.tokenizer)))
    finally:
        speculating.speculation = asked
    return rows


def run_speculative_bench(
    loaded: LoadedModel,
    plain: Engine,
    speculating: Engine,
    *,
    prompt_length: int,
    new_tokens: int,
    runs: int,
    tasks: list[tuple[str, str]],
) -> SpeculativeBenchReport:
    """`tasks`: (label, user message) pairs, run through the model's chat template."""
    assert speculating.speculation is not None
    drafter = speculating.speculation.drafter
    plain.eos_token_ids = speculating.eos_token_ids = loaded.eos_token_ids
    report = SpeculativeBenchReport(
        model=loaded.name,
        device=str(loaded.device),
        dtype=loaded.dtype_name,
        quant=loaded.quant,
        engine=plain.name,
        graphs=plain.backend.captures_graphs,
        method=drafter.method,
        draft=getattr(drafter, "name", None),
        runs=runs,
        new_tokens=new_tokens,
        random_weights=loaded.tokenizer is None,
        context=prompt_length,
        int4_cuda_kernel=_int4_cuda_kernel(loaded),
    )
    for task, ids in tasks_for(loaded, prompt_length, tasks):
        if len(ids) + 2 > loaded.context_length:
            report.skipped.append(f"{task} ({len(ids)} tokens; the context holds {loaded.context_length})")
            continue
        budget = min(new_tokens, loaded.context_length - len(ids) - 1)
        measured = compare(plain, speculating, ids, budget, runs, loaded.tokenizer)
        report.rows.append(_row(task, *measured))
        if report.random_weights and drafter.method == "lookup":  # its stand-in on copied text
            report.rows += _replay_rows(loaded, plain, speculating, ids, budget, runs, measured[2].token_ids)
    vocab = loaded.model.config.get_text_config().vocab_size
    context = prompt_of(max(prompt_length, max(CHECK_LENGTHS)), vocab)
    report.decode_step_s, report.check_s = check_costs(plain, context, runs)
    return report


def break_even_acceptance(drafts: int, cost: float) -> float:
    """The a at which 1 + a + … + a^drafts = cost (a pass of drafts + 1 tokens against a step),
    by bisection; 1.0 where even every draft accepted does not pay."""
    if drafts <= 0 or cost >= drafts + 1:
        return 1.0
    low, high = 0.0, 1.0
    for _ in range(50):
        middle = (low + high) / 2
        if sum(middle**i for i in range(drafts + 1)) < cost:
            low = middle
        else:
            high = middle
    return high


class ReplayDrafter:
    """Drafts the tokens a plain run wrote after the same prompt, about one in `wrong_every`
    made wrong (0: none): a stand-in for lookup on a reply that copies its prompt, where the model's
    weights are random and its text never repeats. Free, like a lookup."""

    method = "lookup"
    free = True

    def __init__(self, prompt_length: int, reference: list[int], wrong_every: int, vocab_size: int) -> None:
        self.prompt_length, self.reference, self.vocab_size = prompt_length, reference, vocab_size
        # Wrong at random places (seeded): at fixed intervals the draft-length rule would learn
        # where drafts break and stop just before, which no real text allows.
        chance = random.Random(wrong_every)
        self.wrong = {i for i in range(len(reference)) if wrong_every and chance.random() * wrong_every < 1}

    def start(self, prompt: list[int]) -> None:
        pass

    def propose(self, context: list[int], limit: int, params: Any, generator: Any) -> Any:
        from llmcli.engine.speculative.drafters import Draft

        written = len(context) - self.prompt_length
        tokens = self.reference[written : written + max(limit, 0)]
        return Draft([self._spoiled(written + i, token) for i, token in enumerate(tokens)])

    def _spoiled(self, index: int, token: int) -> int:
        return (token + 1) % self.vocab_size if index in self.wrong else token

    def restore_consistency(self) -> None:
        pass
