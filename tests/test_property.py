"""Property: with random arrivals, deadlines, cancellations and faults, every accepted request is
answered exactly once, nothing withdrawn is run, and the ledger returns to its load-time value.

Each example runs on a virtual clock (tests/virtual_clock.py): arrivals, deadlines, cancellations,
batching delays and the scripted batches' costs are virtual milliseconds, so an example takes no
real time to wait out and plays the same on a busy machine as on an idle one."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from router.errors import DeadlineExceeded, RouterError
from router.sdk.plugin import Payload
from router.serving.facade import Answer
from router.serving.plan import load_plan
from router.serving.runtime import Runtime, in_process
from tests.conftest import read_records
from tests.virtual_clock import run_virtual

FLEET = """
devices:
  cpu: {probe: none, memory_budget: 10MB}
models:
  a:
    plugin: scripted
    options: {fixed_ms: 3, per_item_ms: 1, fail: marked, oom_marker: "oom", weights_bytes: 2000000,
              per_item_bytes: 1000000, record: "RECORD"}
    queue: {max_size: 6}
    batch: {max_size: 4, max_delay_ms: 5}
    warmup: {enabled: false}
  b:
    plugin: scripted
    options: {fixed_ms: 2, fail: marked, oom_above: 2, weights_bytes: 1000000, per_item_bytes: 2000000,
              record: "RECORD"}
    devices: [cpu, cpu]
    queue: {max_size: 6}
    batch: {max_size: 3, max_delay_ms: 2}
    warmup: {enabled: false}
"""


@dataclass(frozen=True)
class Arrival:
    model: str
    kind: str  # "ok", "fail" (model raises) or "oom" (out of memory)
    delay_ms: int
    timeout_ms: int
    cancel_after_ms: int | None
    priority: int


arrivals = st.builds(
    Arrival,
    model=st.sampled_from(["a", "b"]),
    kind=st.sampled_from(["ok", "ok", "ok", "fail", "oom"]),
    delay_ms=st.integers(0, 30),
    timeout_ms=st.integers(1, 80),
    cancel_after_ms=st.none() | st.integers(0, 30),
    priority=st.integers(1, 3),
)


def ledger(runtime: Runtime) -> dict[str, tuple[int, int]]:
    """Weights and reservations booked on each device."""
    return {d.name: (d.weights_bytes, d.reserved_bytes) for d in runtime.devices()}


async def scenario(runtime: Runtime, plan: list[Arrival], record: Path) -> tuple[list[object], Counter[str]]:
    await runtime.start()
    await runtime.core.wait_loaded()
    weights = ledger(runtime)

    async def one(index: int, arrival: Arrival) -> object:
        await asyncio.sleep(arrival.delay_ms / 1000)
        ident = f"{arrival.kind}-{index}"
        body = json.dumps({"id": ident}).encode()
        work = asyncio.create_task(runtime.submit(
            arrival.model, Payload(body, "application/json"), priority=arrival.priority, timeout_ms=arrival.timeout_ms
        ))
        if arrival.cancel_after_ms is not None:
            await asyncio.sleep(arrival.cancel_after_ms / 1000)
            work.cancel()
        try:
            return await work
        except asyncio.CancelledError:
            return "cancelled"
        except RouterError as exc:
            return exc

    results = await asyncio.wait_for(asyncio.gather(*(one(i, a) for i, a in enumerate(plan))), 30)
    for _ in range(100):  # batches of cancelled requests may still be finishing
        if all(d.running_batches == 0 for d in runtime.devices()):
            break
        await asyncio.sleep(0.01)
    runs: Counter[str] = Counter()
    for row in read_records(record):
        runs.update(row["ids"])  # type: ignore[arg-type]
    assert ledger(runtime) == weights
    assert all(reserved == 0 for _, reserved in ledger(runtime).values())
    assert all(m.queue_depth == 0 for m in runtime.models())
    assert runtime.in_flight == 0
    await runtime.drain(0.5)
    await runtime.stop()
    return results, runs


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(plan=st.lists(arrivals, min_size=1, max_size=14))
def test_every_request_answered_exactly_once(tmp_path: Path, plan: list[Arrival]) -> None:
    config = tmp_path / "fleet.yaml"
    record = tmp_path / f"batches-{uuid.uuid4().hex}.jsonl"  # hypothesis reuses tmp_path across examples
    config.write_text(FLEET.replace("RECORD", str(record)), encoding="utf-8")
    fleet = load_plan(config)
    results, runs = run_virtual(lambda loop: scenario(in_process(fleet, clock=loop.time), plan, record))

    assert len(results) == len(plan)
    for index, (arrival, result) in enumerate(zip(plan, results)):
        ident = f"{arrival.kind}-{index}"
        assert isinstance(result, (Answer, RouterError)) or result == "cancelled", result
        if isinstance(result, Answer):
            assert result.output["id"] == ident  # the answer is this request's own
            assert arrival.kind == "ok" or (arrival.kind == "oom" and arrival.model == "b")
            assert runs[ident] == 1
        if isinstance(result, DeadlineExceeded) and "not run" in result.detail:
            assert runs[ident] == 0  # withdrawn from the queue: never executed
        if isinstance(result, RouterError) and arrival.kind == "ok":
            assert result.status_code in (503, 504, 500), result
    # No input ever runs in two successful batches (a failed batch may be retried in halves).
    assert all(count <= 1 for ident, count in runs.items() if ident.startswith("ok"))
