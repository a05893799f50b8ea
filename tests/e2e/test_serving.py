"""End-to-end: a real `model-router serve` process on a loopback port, driven over HTTP."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from router_testkit.toy import IN_FEATURES, build_model

from tests.conftest import RouterProcess, metric_value, read_records, serve

pytestmark = pytest.mark.e2e

TOY_FLEET = """
devices:
  cpu: {}
models:
  toy:
    plugin: toy
    options: {seed: 7}
    queue: {max_size: 128, timeout_ms: 20000}
    batch: {max_size: 8, max_delay_ms: 300}
"""


def vectors(count: int, seed: int = 0) -> list[list[float]]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(count, IN_FEATURES, generator=generator).tolist()


async def post_json(client: httpx.AsyncClient, path: str, body: object, **headers: str) -> httpx.Response:
    return await client.post(path, content=json.dumps(body), headers={"content-type": "application/json", **headers})


def test_batching_groups_concurrent_requests_and_keeps_answers(tmp_path: Path) -> None:
    inputs = vectors(32, seed=3)
    with serve(tmp_path, TOY_FLEET) as server:

        async def run() -> list[httpx.Response]:
            async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
                return await asyncio.gather(*(post_json(client, "/models/toy/predict", {"x": x}) for x in inputs))

        responses = asyncio.run(run())
        metrics = httpx.get(server.url + "/metrics").text
    assert [r.status_code for r in responses] == [200] * 32
    batches = metric_value(metrics, "model_router_batch_size_count", model="toy")
    items = metric_value(metrics, "model_router_batch_size_sum", model="toy")
    assert items == 32
    assert 1 <= batches <= 5, f"32 requests ran in {batches} batches"
    model = build_model(7, 32)
    with torch.inference_mode():
        for x, response in zip(inputs, responses):
            direct = model(torch.tensor([x])).squeeze(0)
            served = torch.tensor(response.json()["result"]["logits"])
            torch.testing.assert_close(served, direct, rtol=1e-5, atol=1e-5)
    assert max(r.json()["timing"]["batch_size"] for r in responses) > 1


SLOW_FLEET = """
devices:
  cpu: {{}}
models:
  slow:
    plugin: scripted
    options: {{fixed_ms: {fixed_ms}, record: "{record}"}}
    batch: {{max_size: 1}}
"""


def running(server: RouterProcess, model: str = "slow") -> Awaitable[dict[str, Any]]:
    """Until the model's one instance runs a batch (from a coroutine)."""
    return asyncio.to_thread(server.until_model, model, lambda m: m["instances"][0]["busy"])


def accepted(count: int) -> Callable[[dict[str, Any]], bool]:
    """A model state where `count` requests are in: queued, running (batches of one) or answered."""
    return lambda m: m["queue"]["depth"] + sum(i["busy"] for i in m["instances"]) + sum(m["requests"].values()) >= count


def batch_end(record: Path, ident: str) -> float:
    """When the batch holding `ident` ended, on the server's monotonic clock (the machine's)."""
    return float(next(row["end"] for row in read_records(record) if ident in row["ids"]))  # type: ignore[arg-type, operator]


def test_deadline_answers_504_on_time_and_never_runs_the_input(tmp_path: Path, record_file: Path) -> None:
    """Liveness and the 504 arrive while the batch before them still runs (CLOCK_MONOTONIC is one
    clock for the server and this process), and the late input is never run."""
    with serve(tmp_path, SLOW_FLEET.format(fixed_ms=1500, record=record_file)) as server:

        async def run() -> tuple[httpx.Response, httpx.Response, httpx.Response, float, float, float]:
            async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
                first = asyncio.create_task(post_json(client, "/models/slow/predict", {"id": "running"}))
                await running(server)
                live = await client.get("/health/live")
                live_at = time.monotonic()
                sent = time.monotonic()
                late = await post_json(client, "/models/slow/predict", {"id": "late"}, **{"X-Timeout-Ms": "200"})
                late_at = time.monotonic()
                answered = await first
                # First in, first out: had "late" stayed in the queue, it would run before "after".
                after = await post_json(client, "/models/slow/predict", {"id": "after"})
                assert live.status_code == 200
                return answered, late, after, live_at, late_at - sent, late_at

        first, late, after, live_at, waited, late_at = asyncio.run(run())
    assert first.status_code == 200 and after.status_code == 200
    assert late.status_code == 504, late.text
    assert "not run" in late.json()["detail"]
    assert live_at < batch_end(record_file, "running"), "liveness waited for the batch"
    assert late_at < batch_end(record_file, "running"), "the 504 waited for the batch before it"
    assert waited >= 0.2  # not before its deadline either
    executed = [i for row in read_records(record_file) for i in row["ids"]]  # type: ignore[union-attr]
    assert executed == ["running", "after"]


def test_timeout_header_cannot_lengthen_the_deadline(tmp_path: Path, record_file: Path) -> None:
    fleet = SLOW_FLEET.format(fixed_ms=600, record=record_file).replace(
        "batch: {max_size: 1}", "batch: {max_size: 1}\n    queue: {timeout_ms: 150}")
    with serve(tmp_path, fleet) as server:

        async def run() -> httpx.Response:
            async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
                first = asyncio.create_task(post_json(client, "/models/slow/predict", {"id": "a"}))
                await running(server)
                late = await post_json(client, "/models/slow/predict", {"id": "b"}, **{"X-Timeout-Ms": "60000"})
                await first
                return late

        assert asyncio.run(run()).status_code == 504


BUDGET_FLEET = """
devices:
  cpu: {{probe: none, memory_budget: 100MB, max_concurrent_batches: 2}}  # the budget alone decides
models:
  first:
    plugin: scripted
    options: {{fixed_ms: 250, weights_bytes: 10000000, per_item_bytes: {per_item}, record: "{record}"}}
    batch: {{max_size: 1}}
  second:
    plugin: scripted
    options: {{fixed_ms: 250, weights_bytes: 10000000, per_item_bytes: {per_item}, record: "{record}"}}
    batch: {{max_size: 1}}
"""


def _overlaps(rows: list[dict[str, object]]) -> int:
    first = [(r["start"], r["end"]) for r in rows if r["model"] == "first"]
    second = [(r["start"], r["end"]) for r in rows if r["model"] == "second"]
    return sum(1 for a in first for b in second if a[0] < b[1] and b[0] < a[1])  # type: ignore[operator]


@pytest.mark.parametrize(("per_item", "may_overlap"), [(50_000_000, False), (30_000_000, True)])
def test_budget_decides_whether_two_models_run_together(
    tmp_path: Path, record_file: Path, per_item: int, may_overlap: bool
) -> None:
    # Budget 100 MB, weights 2 x 10 MB: two batches of 50 MB exceed it, two of 30 MB fit.
    with serve(tmp_path, BUDGET_FLEET.format(per_item=per_item, record=record_file)) as server:

        async def run() -> list[httpx.Response]:
            async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
                return await asyncio.gather(*(
                    post_json(client, f"/models/{model}/predict", {"id": f"{model}-{i}"})
                    for i in range(3) for model in ("first", "second")
                ))

        responses = asyncio.run(run())
        metrics = httpx.get(server.url + "/metrics").text
    assert all(r.status_code == 200 for r in responses)
    rows = read_records(record_file)
    assert len(rows) == 6
    if may_overlap:
        assert _overlaps(rows) > 0, "batches that fit together should run concurrently"
    else:
        assert _overlaps(rows) == 0, f"batches over budget overlapped: {rows}"
    assert metric_value(metrics, "model_router_ledger_reserved_bytes", device="cpu") == 0
    assert metric_value(metrics, "model_router_ledger_weights_bytes", device="cpu") == 20_000_000


FAULT_FLEET = """
models:
  broken:
    plugin: scripted
    options: {{fail: always}}
    warmup: {{enabled: false}}
  healthy:
    plugin: scripted
    options: {{fixed_ms: 5}}
  unloadable:
    plugin: scripted
    options: {{load_error: "weights file is corrupt"}}
    required: false
"""


def test_a_failing_model_does_not_stop_another(tmp_path: Path) -> None:
    with serve(tmp_path, FAULT_FLEET.format()) as server:

        async def run() -> list[httpx.Response]:
            async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
                calls = [post_json(client, f"/models/{m}/predict", {"id": f"{m}{i}"})
                         for i in range(5) for m in ("broken", "healthy")]
                return await asyncio.gather(*calls)

        responses = asyncio.run(run())
        unloadable = httpx.post(server.url + "/models/unloadable/predict", json={"id": "x"})
        models = {m["name"]: m for m in httpx.get(server.url + "/models").json()["models"]}
        ready = httpx.get(server.url + "/health/ready")
    by_model: dict[str, list[int]] = {}
    for response in responses:
        by_model.setdefault(response.request.url.path.split("/")[2], []).append(response.status_code)
    assert by_model == {"broken": [500] * 5, "healthy": [200] * 5}
    assert "scripted failure" in responses[0].json()["detail"]
    assert unloadable.status_code == 503 and "weights file is corrupt" in unloadable.json()["detail"]
    assert models["unloadable"]["state"] == "failed"
    assert ready.status_code == 200, "an optional model's failure must not hold readiness"


def test_client_that_went_away_is_dropped_before_its_batch(tmp_path: Path, record_file: Path) -> None:
    with serve(tmp_path, SLOW_FLEET.format(fixed_ms=1500, record=record_file)) as server:

        async def run() -> tuple[httpx.Response, httpx.Response]:
            async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
                first = asyncio.create_task(post_json(client, "/models/slow/predict", {"id": "kept"}))
                await running(server)
                body = b'{"id": "gone"}'
                host, port = server.url.removeprefix("http://").split(":")
                with socket.create_connection((host, int(port))) as sock:
                    sock.sendall(b"POST /models/slow/predict HTTP/1.1\r\nHost: x\r\n"
                                 b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
                    await asyncio.to_thread(server.until_model, "slow", lambda m: m["queue"]["depth"] == 1)
                await asyncio.to_thread(server.until_model, "slow", lambda m: m["queue"]["depth"] == 0)  # withdrawn
                kept = await first
                # First in, first out: had "gone" stayed in the queue, it would run before "after".
                return kept, await post_json(client, "/models/slow/predict", {"id": "after"})

        kept, after = asyncio.run(run())
        metrics = httpx.get(server.url + "/metrics").text
    assert kept.status_code == 200 and after.status_code == 200
    executed = [i for row in read_records(record_file) for i in row["ids"]]  # type: ignore[union-attr]
    assert executed == ["kept", "after"]
    assert metric_value(metrics, "model_router_requests_total", model="slow", outcome="cancelled") == 1


def test_readiness_waits_for_load_and_warm_up(tmp_path: Path) -> None:
    fleet = """
models:
  slowload:
    plugin: scripted
    options: {load_ms: 1500}
"""
    with serve(tmp_path, fleet, wait_ready=False) as server:
        early = httpx.get(server.url + "/health/ready")
        early_predict = httpx.post(server.url + "/models/slowload/predict", json={"id": "x"})
        deadline = time.monotonic() + 30
        while httpx.get(server.url + "/health/ready").status_code != 200:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        later = httpx.post(server.url + "/models/slowload/predict", json={"id": "y"})
        warmups = [r for r in server.log_records() if "warm-up" in str(r.get("message"))]
    assert early.status_code == 503 and early.json()["ready"] is False
    assert early_predict.status_code == 503 and "Retry-After" in early_predict.headers
    assert later.status_code == 200
    assert warmups, "warm-up should log its progress"


def test_sigterm_drains_queued_and_running_requests(tmp_path: Path, record_file: Path) -> None:
    with serve(tmp_path, SLOW_FLEET.format(fixed_ms=300, record=record_file)) as server:

        async def run() -> tuple[list[httpx.Response], httpx.Response]:
            async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
                queued = [asyncio.create_task(post_json(client, "/models/slow/predict", {"id": f"q{i}"}))
                          for i in range(5)]
                await asyncio.to_thread(server.until_model, "slow", accepted(5))
                server.process.send_signal(15)
                while (await client.get("/health/ready")).status_code == 200:  # until the drain has begun
                    await asyncio.sleep(0.01)
                refused = await post_json(client, "/models/slow/predict", {"id": "after"})
                return list(await asyncio.gather(*queued)), refused

        answered, refused = asyncio.run(run())
        code = server.process.wait(30)
    assert [r.status_code for r in answered] == [200] * 5
    assert refused.status_code == 503 and "shutting down" in refused.json()["detail"]
    assert code in (0, -15)
    executed = sorted(i for row in read_records(record_file) for i in row["ids"])  # type: ignore[union-attr]
    assert executed == [f"q{i}" for i in range(5)]
