"""A request's execution as trace phases, made in the front from the facts of the batch it rode
(`dispatched_at`, `finished_at`, `link`), so that it reads the same whether the batch ran
in this process or in another."""

from __future__ import annotations

from router.scheduling.queue import BatchFacts
from router.tracing.api import Phases

__all__ = ["trace_execution"]


def trace_execution(trace: Phases, batch: BatchFacts | None, now: float, error: BaseException | None = None) -> None:
    """A dispatched ticket's execute phase, from dispatch to its batch's end (linked to the batch
    span); then postprocess from the batch's end, or the error the batch ended with."""
    if batch is None:
        return  # never dispatched: the open queue wait is what failed
    ended = batch.finished_at if batch.finished_at else now
    if error is None:
        trace.enter("execute", batch.dispatched_at, link=batch.link, **{"router.batch.size": batch.size})
        trace.enter("postprocess", ended)
    else:
        trace.enter("execute", batch.dispatched_at, link=batch.link)
        trace.leave(ended, error)
