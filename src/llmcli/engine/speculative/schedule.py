"""How many tokens to draft next: a fixed number (--draft-tokens), or the number that promises
the most tokens per second, from what this very run has measured.

A round that drafts k tokens yields on average 1 + a₁ + a₁a₂ + … + a₁…a_k tokens (the accepted
run plus the model's own next token), a_i the chance that drafted token i is accepted once the
ones before it were: measured per position, since a lookup's drafts tend to hold for a whole run
or fail at once, which one rate for every position misjudges. A position seldom reached leans on
the rate over all positions. The round costs one model pass over k + 1 tokens plus k drafting
steps. Passes are measured by the rows the backend really runs: with CUDA graphs a pass of 3
tokens replays the graph of 4 (backend.GRAPHED_ROWS), so it costs what 4 do, and a size not
measured yet is read off a line through the sizes that were (or, before a second size is seen,
a prior). k = 0 (a plain decode step) wins whenever drafts stop paying, so speculation on text
that does not repeat itself costs almost nothing; a lookup draft is free to make, so its
acceptance keeps being measured even then and speculation resumes when the text starts
repeating.
"""

from __future__ import annotations

from collections.abc import Callable

# The drafts and the model's own token make a pass of at most 16 rows: the largest one a CUDA graph
# replays (native/backend.py's GRAPHED_ROWS); a 17th row would run eagerly, a few steps' worth.
MOST_DRAFT_TOKENS = 15
FIRST_DRAFT_TOKENS = 3  # before anything is measured
DECAY = 0.85  # weight of the past in the running estimates: forgets in about ten rounds
# Before a second pass size is measured, each extra token is assumed to cost this fraction of a
# one-token pass (memory-bound decode barely notices a few more rows).
PRIOR_EXTRA_TOKEN_COST = 0.1
# A pass that also captured a CUDA graph (a new shape, a cache that moved) can take a hundred
# times its usual time; counting it whole would stop drafts of that size for good. A sample is
# taken at most this many times the running estimate, so a one-off spike moves it little while
# a lasting change still comes through, step by step.
MOST_SAMPLE_RATIO = 2.0
# A drafter that costs a pass (a draft model) is measured only when it drafts: while drafts do
# not pay, it still drafts one token once in this many rounds, so a text it starts to predict
# well brings it back, and a draft model that never agrees costs little.
PROBE_EVERY = 8
# A position's own counts weigh against the rate over all positions as if that one had been seen
# this many times: a position reached once does not decide alone.
POSITION_PRIOR_ROUNDS = 2.0


class DraftLength:
    """`pass_rows`: the rows a pass of so many tokens really runs (the backend's padding; one
    for one by default); the producer sets it from the engine's backend."""

    def __init__(self, fixed: int | None = None, most: int = MOST_DRAFT_TOKENS) -> None:
        self.fixed = fixed
        self.most = fixed if fixed is not None else most
        self.pass_rows: Callable[[int], int] = _same
        self._pass_seconds: dict[int, float] = {}  # running mean by rows run
        self._passed_once: set[int] = set()  # rows whose first pass was seen (and not counted)
        self._draft_seconds_per_token: float | None = None
        self._matched = 1.0  # running counts over all positions, from one success and one failure
        self._missed = 1.0
        self._reached: list[float] = []  # by draft position: running count of drafts compared there
        self._agreed: list[float] = []  # … and of those accepted there
        self._rounds_since_probe = 0

    @property
    def acceptance(self) -> float:
        """The chance a drafted token is accepted, over all positions."""
        return self._matched / (self._matched + self._missed)

    def acceptance_at(self, position: int) -> float:
        """The chance drafted token `position` (from 0) is accepted once those before it were."""
        pooled = self.acceptance
        if position >= len(self._reached):
            return pooled
        prior = POSITION_PRIOR_ROUNDS
        return (self._agreed[position] + prior * pooled) / (self._reached[position] + prior)

    def expected_tokens(self, drafted: int) -> float:
        """Tokens a round that checks `drafted` tokens yields on average, the model's own included."""
        expected, run = 1.0, 1.0
        for position in range(drafted):
            run *= self.acceptance_at(position)
            expected += run
        return expected

    def observe_pass(self, fed: int, seconds: float) -> None:
        rows = self.pass_rows(fed)
        if rows not in self._passed_once:
            # With CUDA graphs a size's first pass is the one that captured its graph, a hundred
            # times its cost: counted, it would price that size out before it ever ran again.
            self._passed_once.add(rows)
            return
        last = self._pass_seconds.get(rows)
        self._pass_seconds[rows] = seconds if last is None else _blend(last, seconds)

    def observe_drafting(self, drafted: int, seconds: float) -> None:
        if drafted > 0:
            per_token, last = seconds / drafted, self._draft_seconds_per_token
            self._draft_seconds_per_token = per_token if last is None else _blend(last, per_token)

    def observe_match(self, proposed: list[int], chosen: list[int]) -> None:
        """How far a draft (checked or not) agreed with the tokens that came out."""
        matched = agreeing(chosen, proposed)
        compared = min(len(proposed), len(chosen))
        if compared == 0:
            return
        self._matched = DECAY * self._matched + matched
        self._missed = DECAY * self._missed + (1 if matched < compared else 0)
        # Positions up to the first disagreement were reached; those after it say nothing.
        reached = min(matched + 1, compared)
        while len(self._reached) < reached:
            self._reached.append(0.0)
            self._agreed.append(0.0)
        for position in range(reached):
            self._reached[position] = DECAY * self._reached[position] + 1
            self._agreed[position] = DECAY * self._agreed[position] + (1 if position < matched else 0)

    def next(self, available: int, probing: bool = False) -> int:
        """Tokens to draft this round, given that at most `available` can be used. `probing`: a
        drafter measured only when it drafts (see PROBE_EVERY)."""
        if available <= 0:
            return 0
        if self.fixed is not None:
            return min(self.fixed, available)
        if not self._pass_seconds:
            return min(FIRST_DRAFT_TOKENS, available)
        best = self.best(min(self.most, available))
        if best == 0 and probing:
            self._rounds_since_probe += 1
            if self._rounds_since_probe >= PROBE_EVERY:
                self._rounds_since_probe = 0
                return 1
        return best

    def best(self, most: int) -> int:
        """The draft length of at most `most` with the most tokens per second expected; 0 (a
        plain decode step) when no draft pays."""
        draft_cost = self._draft_seconds_per_token or 0.0
        best, best_rate = 0, 0.0
        for k in range(most + 1):
            rate = self.expected_tokens(k) / (self.pass_seconds(k + 1) + k * draft_cost)
            if rate > best_rate:
                best, best_rate = k, rate
        return best

    def pass_seconds(self, fed: int) -> float:
        """A model pass over `fed` tokens: measured (at the rows it runs), else on the line
        through what was measured."""
        seen, rows = self._pass_seconds, self.pass_rows(fed)
        if rows in seen:
            return seen[rows]
        if len(seen) == 1:
            ((size, seconds),) = seen.items()
            one_token = seconds / (1 + PRIOR_EXTRA_TOKEN_COST * (size - 1))
            return one_token * (1 + PRIOR_EXTRA_TOKEN_COST * (rows - 1))
        # Least squares through (rows, seconds); never cheaper than the cheapest pass seen.
        sizes, times = list(seen), list(seen.values())
        mean_size, mean_time = sum(sizes) / len(sizes), sum(times) / len(times)
        spread = sum((s - mean_size) ** 2 for s in sizes)
        slope = sum((s - mean_size) * (t - mean_time) for s, t in zip(sizes, times, strict=True)) / spread
        return max(mean_time + max(slope, 0.0) * (rows - mean_size), min(times))


def _same(fed: int) -> int:
    return fed


def _blend(running: float, new: float) -> float:
    return DECAY * running + (1 - DECAY) * min(new, MOST_SAMPLE_RATIO * running)


def agreeing(chosen: list[int], drafted: list[int]) -> int:
    """How many drafted tokens, from the first, equal the tokens chosen in their place."""
    agreed = 0
    for token, drafted_token in zip(chosen, drafted, strict=False):
        if token != drafted_token:
            break
        agreed += 1
    return agreed
