"""A request's execution as trace phases, made in the front from the timestamps its ticket brings
back (`dispatched_at`, `finished_at`, `batch_trace`), so that it reads the same whether the batch
ran in this process or in another."""

from __future__ import annotations

from router.scheduling.queue import Ticket
from router.tracing.api import Phases

__all__ = ["trace_execution"]


def trace_execution(trace: Phases, ticket: Ticket, now: float, error: BaseException | None = None) -> None:
    """A dispatched ticket's execute phase, from dispatch to its batch's end (linked to the batch
    span); then postprocess from the batch's end, or the error the batch ended with."""
    if ticket.dispatched_at is None:
        return  # never dispatched: the open queue wait is what failed
    ended = ticket.finished_at if ticket.finished_at is not None else now
    if error is None:
        trace.enter("execute", ticket.dispatched_at, link=ticket.batch_trace, **{"router.batch.size": ticket.batch_size})
        trace.enter("postprocess", ended)
    else:
        trace.enter("execute", ticket.dispatched_at, link=ticket.batch_trace)
        trace.leave(ended, error)
