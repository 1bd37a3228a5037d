"""The adaptive draft length (engine/speculative/schedule.py) on injected pass costs and
acceptance sequences: no clock is read, so each choice is exact."""

from __future__ import annotations

import pytest
import torch

from llmcli.engine.native.backend import GRAPHED_ROWS
from llmcli.engine.speculative.schedule import DraftLength

# Seconds of a pass by the rows it runs, relative to a decode step: what the H100 measured for
# 8B int4 before the few-rows kernel (docs/benchmarks.md), and for 8B bf16.
INT4_TINYGEMM = {1: 1.0, 2: 1.17, 4: 1.45, 8: 2.11, 16: 3.0}
BF16 = {1: 1.0, 2: 1.06, 4: 1.07, 8: 1.08, 16: 1.09}


def padded(fed: int) -> int:
    """The rows a graphed pass of `fed` tokens replays (backend.pass_rows with graphs)."""
    return next((rows for rows in GRAPHED_ROWS if rows >= fed), fed) if fed > 1 else 1


def measured(costs: dict[int, float], rows_of=padded, fixed: int | None = None) -> DraftLength:
    length = DraftLength(fixed)
    length.pass_rows = rows_of
    for rows, seconds in costs.items():
        length.observe_pass(rows, 100 * seconds)  # the first pass of a size: its graph's capture
        length.observe_pass(rows, seconds)
    return length


def observe_rounds(length: DraftLength, accepted: list[int], drafted: int = 16) -> None:
    """Rounds whose drafts of `drafted` tokens the model accepted up to each count in turn."""
    proposal = list(range(drafted))
    for run in accepted:
        chosen = [*proposal[:run], -1]  # the model's own token after the run, never a draft
        length.observe_match(proposal, chosen)


def test_a_draft_that_always_breaks_at_the_same_place_is_drafted_up_to_there() -> None:
    """Drafts right for three tokens and wrong at the fourth, every time: one rate over all
    positions (0.75) would draft five; per position, the fourth is seen to fail."""
    length = measured({rows: 1 + 0.1 * (rows - 1) for rows in range(1, 17)}, rows_of=lambda fed: fed)
    observe_rounds(length, [3] * 30)
    assert length.acceptance == pytest.approx(0.75, abs=0.01)
    assert length.acceptance_at(3) < 0.2 < 0.9 < length.acceptance_at(2)
    assert length.next(16) == 3


@pytest.mark.parametrize("accepted", [[16], [6], [2, 9, 4], [5, 1, 12, 3]])
def test_graphed_passes_are_drafted_to_fill_their_padding(accepted: list[int]) -> None:
    """A pass of 6 tokens replays the graph of 8: drafting 7 costs what drafting 5 does, so with
    room to spare a draft fills its pass (and one pass's rows are measured once for all)."""
    length = measured(INT4_TINYGEMM)
    observe_rounds(length, accepted * 10)
    assert length.pass_seconds(6) == length.pass_seconds(8) == INT4_TINYGEMM[8]
    assert length.next(16) + 1 in GRAPHED_ROWS
    unpadded = measured({rows: INT4_TINYGEMM[padded(rows)] for rows in range(1, 17)}, rows_of=lambda fed: fed)
    observe_rounds(unpadded, accepted * 10)
    assert unpadded.next(16) == length.next(16)  # the same choice as from every size measured


def test_no_draft_when_no_length_pays_and_drafts_again_when_the_text_repeats() -> None:
    length = measured(INT4_TINYGEMM)
    observe_rounds(length, [0] * 9 + [1] + [0] * 9)  # about one draft in ten accepted
    assert length.next(16) == 0  # a plain decode step
    observe_rounds(length, [16] * 12)  # the text starts copying itself
    assert length.next(16) == 15


@pytest.mark.parametrize("accepted", [[2, 0, 5, 1], [4, 1, 8, 0, 3]])
def test_a_cheaper_check_drafts_at_least_as_far(accepted: list[int]) -> None:
    """The same acceptance with bf16's check costs (1.09× a step for 16) against int4's before the
    few-rows kernel (3.0×): the cheaper the check, the longer the draft, never shorter."""
    cheap, dear = measured(BF16), measured(INT4_TINYGEMM)
    for length in (cheap, dear):
        observe_rounds(length, accepted * 8)
    assert cheap.next(16) > dear.next(16) > 0


def test_each_size_is_measured_at_the_rows_it_runs() -> None:
    length = measured({1: 1.0})
    length.observe_pass(4, 140.0)  # the graph of 4 captured: not counted
    length.observe_pass(3, 1.4)  # a pass of 3 tokens ran the graph of 4
    assert length.pass_seconds(4) == length.pass_seconds(3) == 1.4
    assert length.pass_seconds(5) == length.pass_seconds(8) > 1.4  # on the line, at 8 rows


def test_a_graph_capture_on_the_first_pass_of_a_size_does_not_price_it_out() -> None:
    """The first round drafts before any check was measured; on a GPU its pass captures the
    graph of its rows (a hundred steps' worth). Counted, that size would never run again."""
    length = DraftLength()
    length.pass_rows = padded
    for seconds in (50.0, 1.0, 1.0):  # the decode step: its capture, then steps
        length.observe_pass(1, seconds)
    observe_rounds(length, [16] * 10)
    first = length.next(16)
    length.observe_pass(first + 1, 150.0)  # its capture
    length.observe_pass(first + 1, 1.3)
    assert length.pass_seconds(first + 1) == 1.3 and length.next(16) > 0


def test_a_fixed_length_stays_fixed_whatever_pays() -> None:
    length = measured(INT4_TINYGEMM, fixed=5)
    observe_rounds(length, [0] * 20)
    assert length.next(16) == 5 and length.next(3) == 3


def test_the_native_backend_says_what_a_pass_runs(tiny_llama_loaded) -> None:
    """Without graphs every pass runs its own rows (on a GPU: tests/test_gpu.py, padded)."""
    from llmcli.engine.native.backend import NativeBackend

    backend = NativeBackend(tiny_llama_loaded.model, tiny_llama_loaded.context_length, static_shapes=True)
    assert [backend.pass_rows(fed) for fed in (1, 3, 16, 17)] == [1, 3, 16, 17]


@pytest.fixture(scope="module")
def tiny_llama_loaded(tiny_llama):
    from llmcli.config.settings import LoadSettings
    from llmcli.models.load import load_model
    from llmcli.models.resolve import ResolvedModel

    settings = LoadSettings(device="cpu", dtype="fp32", threads=1)
    return load_model(ResolvedModel(name="tiny", path=tiny_llama, source="folder"), settings)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_graphed_backend_pads_its_passes(tiny_llama) -> None:
    from llmcli.config.settings import LoadSettings
    from llmcli.engine.native.backend import NativeBackend
    from llmcli.models.load import load_model
    from llmcli.models.resolve import ResolvedModel

    settings = LoadSettings(device="cuda", dtype="bf16")
    loaded = load_model(ResolvedModel(name="tiny", path=tiny_llama, source="folder"), settings)
    backend = NativeBackend(loaded.model, loaded.context_length, graphs=True)
    assert [backend.pass_rows(fed) for fed in (1, 2, 3, 5, 9, 16, 17)] == [1, 2, 4, 8, 16, 16, 17]


def test_the_longest_draft_fits_the_largest_graphed_pass() -> None:
    """16 drafts and the model's token would be a pass of 17 rows: no graph, a few steps' cost."""
    length = measured({rows: 1.0 for rows in GRAPHED_ROWS})  # every pass as cheap as a step
    observe_rounds(length, [16] * 20)
    assert length.next(64) + 1 == GRAPHED_ROWS[-1]
