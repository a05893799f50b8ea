"""The request rules' two steps, counted in this process (`router.serving.rules.EVALUATIONS`):
a request the front screened is committed once and never screened again; one that comes
unscreened is screened by a front whose queues are elsewhere (the cluster's), and only committed
by one process. The cluster front's replica is a `Runtime` in this process, so both steps show here
(tests/e2e/test_rule_evaluations.py counts them over real servers, one process and a split host)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from router.serving.rules import EVALUATIONS
from tests.test_request_rules import ask, front

#: (screens, commits) of a submit, given the screen's value or not, by front.
EXPECTED = {
    "one process": {"screened": (0, 1), "unscreened": (0, 1)},
    "cluster front": {"screened": (0, 1), "unscreened": (1, 1)},
}


def steps(before: Counter[str]) -> tuple[int, int]:
    now = EVALUATIONS.counts
    return now["screen"] - before["screen"], now["commit"] - before["commit"]


@pytest.mark.parametrize("kind", list(EXPECTED))
async def test_a_screened_request_is_committed_once_and_not_screened_again(kind: str, tmp_path: Path) -> None:
    async with front(kind, tmp_path) as served:
        before = Counter(EVALUATIONS.counts)
        screened = served.facade.screen("m", priority=2, timeout_ms=4000)
        assert steps(before) == (1, 0)
        assert screened.terms.priority == 2 and screened.deadline - screened.terms.received_at == pytest.approx(4.0)
        before = Counter(EVALUATIONS.counts)
        answer = await served.facade.submit("m", ask("screened"), priority=2, timeout_ms=4000, screened=screened)
        assert answer.model == "m" and steps(before) == EXPECTED[kind]["screened"]
        before = Counter(EVALUATIONS.counts)
        await served.facade.submit("m", ask("unscreened"))
        assert steps(before) == EXPECTED[kind]["unscreened"]
