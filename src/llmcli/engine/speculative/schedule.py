"""How many tokens to draft next: a fixed number (--draft-tokens), or the number that promises
the most tokens per second, from what this very run has measured.

With a per-token acceptance probability a, a round that drafts k tokens yields on average
1 + a + … + a^k tokens (the accepted run plus the model's own next token) and costs one model
pass over k + 1 tokens plus k drafting steps. Both costs and a are measured as the run goes:
pass seconds by tokens fed (a straight line fitted through what was seen), drafting seconds per
token, and a from how far each draft matched the tokens that came out. k = 0 (a plain decode
step) wins whenever drafts stop paying, so speculation on text that does not repeat itself
costs almost nothing; a lookup draft is free to make, so its acceptance keeps being measured
even then and speculation resumes when the text starts repeating.
"""

from __future__ import annotations

MOST_DRAFT_TOKENS = 16
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


class DraftLength:
    def __init__(self, fixed: int | None = None, most: int = MOST_DRAFT_TOKENS) -> None:
        self.fixed = fixed
        self.most = fixed if fixed is not None else most
        self._pass_seconds: dict[int, float] = {}  # running mean by tokens fed
        self._draft_seconds_per_token: float | None = None
        self._matched = 1.0  # running counts, starting from one success and one failure
        self._missed = 1.0
        self._rounds_since_probe = 0

    @property
    def acceptance(self) -> float:
        return self._matched / (self._matched + self._missed)

    def observe_pass(self, fed: int, seconds: float) -> None:
        last = self._pass_seconds.get(fed)
        self._pass_seconds[fed] = seconds if last is None else _blend(last, seconds)

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

    def next(self, available: int, probing: bool = False) -> int:
        """Tokens to draft this round, given that at most `available` can be used. `probing`: a
        drafter measured only when it drafts (see PROBE_EVERY)."""
        if available <= 0:
            return 0
        if self.fixed is not None:
            return min(self.fixed, available)
        if not self._pass_seconds:
            return min(FIRST_DRAFT_TOKENS, available)
        draft_cost = self._draft_seconds_per_token or 0.0
        a = self.acceptance
        best, best_rate = 0, 0.0
        expected = 0.0
        for k in range(min(self.most, available) + 1):
            expected += a**k  # 1 + a + … + a^k
            rate = expected / (self.pass_seconds(k + 1) + k * draft_cost)
            if rate > best_rate:
                best, best_rate = k, rate
        if best == 0 and probing:
            self._rounds_since_probe += 1
            if self._rounds_since_probe >= PROBE_EVERY:
                self._rounds_since_probe = 0
                return 1
        return best

    def pass_seconds(self, fed: int) -> float:
        """A model pass over `fed` tokens: measured, else on the line through what was measured."""
        seen = self._pass_seconds
        if fed in seen:
            return seen[fed]
        if len(seen) == 1:
            ((size, seconds),) = seen.items()
            one_token = seconds / (1 + PRIOR_EXTRA_TOKEN_COST * (size - 1))
            return one_token * (1 + PRIOR_EXTRA_TOKEN_COST * (fed - 1))
        # Least squares through (tokens fed, seconds); never cheaper than the cheapest pass seen.
        sizes, times = list(seen), list(seen.values())
        mean_size, mean_time = sum(sizes) / len(sizes), sum(times) / len(times)
        spread = sum((s - mean_size) ** 2 for s in sizes)
        slope = sum((s - mean_size) * (t - mean_time) for s, t in zip(sizes, times, strict=True)) / spread
        return max(mean_time + max(slope, 0.0) * (fed - mean_size), min(times))


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
