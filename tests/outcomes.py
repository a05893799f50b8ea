"""Tickets for tests of the queue, the instances and the schedulers, each with a future that
hears its outcome as a caller of the runtime does: the output, or the error raised."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from router.scheduling.queue import BatchFacts, Outcome, Served, Ticket


@dataclass(eq=False)
class HeardTicket(Ticket):
    """A ticket whose outcome goes to `future` (and the facts of the batch it rode to `batch`)."""

    future: Any = None
    batch: BatchFacts | None = None

    def __post_init__(self) -> None:
        self.reply = self.hear

    def hear(self, outcome: Outcome) -> None:
        self.batch = outcome.batch
        if isinstance(outcome, Served):
            self.future.set_result(outcome.output)
        else:
            self.future.set_exception(outcome.error)
