"""Speculative decoding: draft several tokens cheaply, check them all in one pass of the model.

At batch 1 a decode step reads every weight to make one token; checking K drafted tokens reads
them once too. The drafts come from the text itself (`lookup`: the continuation of the last
n-gram's earlier occurrence) or from a smaller model with the same vocabulary (`draft`). The
loop keeps the longest run of drafts the model agrees with, plus the model's own next token, so
greedy output is the output without speculation, and sampled output keeps its distribution
(`acceptance.py`). How many to draft is chosen each round for the most tokens per second
(`schedule.py`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from llmcli.engine.speculative.drafters import Drafter
    from llmcli.engine.speculative.schedule import DraftLength


@dataclass
class Speculation:
    """What an engine speculates with: a drafter, and the rule for how many tokens it drafts."""

    drafter: Drafter
    length: DraftLength

    @property
    def method(self) -> str:
        return self.drafter.method


@dataclass
class SpeculativeStats:
    method: str
    drafted: int = 0  # drafted tokens the model checked
    accepted: int = 0  # of those, the ones that became output

    @property
    def acceptance_rate(self) -> float | None:
        """Of the drafted tokens checked, the share accepted; None where none was drafted."""
        return self.accepted / self.drafted if self.drafted else None

    def as_dict(self) -> dict[str, object]:
        return {
            "method": self.method,
            "drafted": self.drafted,
            "accepted": self.accepted,
            "acceptance_rate": self.acceptance_rate,
        }
