"""The proposer interface: given the task and the run's history so far, propose the next
candidate source (or None when there is nothing left to try). Proposers keep no state
that the history does not hold, so a resumed run continues where it stopped."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

from wanka.lab.store import Record
from wanka.lab.task import Task


@dataclass(frozen=True)
class Proposal:
    source: str
    config: dict | None = None  # the variant-space point, when there is one
    note: str = ""  # one line on where it came from (shown in reports)
    # Why this is no candidate at all (a malformed model reply): the runner records it as a
    # rejected evaluation with this reason, without evaluating it, and goes on.
    rejected: str = ""


class Proposer(ABC):
    name: str = "?"

    @abstractmethod
    def propose(self, task: Task, history: list[Record]) -> Proposal | None:
        """The next candidate; None when the proposer has nothing new to offer."""
