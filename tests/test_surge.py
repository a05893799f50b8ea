"""The five-fold surge: measure the fleet's capacity, then offer five times that rate, open loop, for
20 s to two models at once from a separate process, and check that the service holds.

The two models are simulated accelerators (the scripted plugin: a batch of n costs a + b*n of wall
time and releases the GIL, as a GPU call does), so the router, not the CPU, is what is measured.
What holds whatever the machine's speed is asserted: only 200, 503 and 504, every 503 with a
Retry-After, no transport error, answers again right after the surge, memory bounded. The speed
figures (goodput over capacity, accepted p99 against the deadline, refusal and recovery latencies)
go to reports/surge.json and the terminal; `make bench` measures them side by side (its 5x
open-loop surges). On a starved machine the event loop fires deadlines late, so even the server's
own p99 can pass the deadline: the deadline logic itself is tested on a virtual clock
(tests/test_runtime.py, tests/test_property.py).
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import psutil
import pytest

from tests.conftest import REPO, RouterProcess, serve

pytestmark = [pytest.mark.load, pytest.mark.e2e]

DEADLINE_S = 1.0
# Capacities of about 33 and 21 requests a second: five times that is within what 2 CPU cores can
# parse and refuse while they also run the two load generators.
MODELS = {"alpha": {"fixed_ms": 200, "per_item_ms": 5, "batch": 8, "queue": 64},
          "beta": {"fixed_ms": 150, "per_item_ms": 10, "batch": 4, "queue": 48}}
# Simulated accelerators: their batches sleep with the GIL released, and overlap as on a GPU.
FLEET = "devices:\n  cpu: {max_concurrent_batches: 8}\nmodels:\n" + "".join(
    f"  {name}:\n    plugin: scripted\n    options: {{fixed_ms: {m['fixed_ms']}, per_item_ms: {m['per_item_ms']}}}\n"
    f"    queue: {{max_size: {m['queue']}, timeout_ms: {int(DEADLINE_S * 1000)}}}\n"
    f"    batch: {{max_size: {m['batch']}, max_delay_ms: 5}}\n"
    for name, m in MODELS.items()
)


def target(model: str) -> str:
    return f'/models/{model}/predict=application/json:{{"id": "{model}"}}'


def loadgen(server: RouterProcess, *args: str) -> subprocess.Popen[str]:
    command = [sys.executable, "-m", "benchmarks.loadgen", "--url", server.url, "--deadline", str(DEADLINE_S), *args]
    return subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def report_of(process: subprocess.Popen[str], timeout: float = 120) -> dict[str, Any]:
    out, err = process.communicate(timeout=timeout)
    assert process.returncode == 0, err[-2000:]
    return json.loads(out)  # type: ignore[no-any-return]


def closed(server: RouterProcess, concurrency: int, seconds: float) -> dict[str, Any]:
    args = [f"--target={target(m)}" for m in MODELS]
    return report_of(loadgen(server, *args, "--concurrency", str(concurrency), "--duration", str(seconds),
                             "--per-target"))


def server_side_ok_ms(records: list[dict[str, Any]]) -> dict[str, list[float]]:
    """Durations of the 200 answers, per model, from the server's own access lines."""
    durations: dict[str, list[float]] = {m: [] for m in MODELS}
    for record in records:
        if record.get("message") == "request" and record.get("status") == 200 and record.get("model") in MODELS:
            durations[str(record["model"])].append(float(record["duration_ms"]))
    return durations


def percentile(values: list[float], q: float) -> float | None:
    return sorted(values)[min(len(values) - 1, int(q * len(values)))] if values else None


class RssSampler(threading.Thread):
    """Peak resident memory of the server process, sampled every 200 ms."""

    def __init__(self, pid: int) -> None:
        super().__init__(daemon=True)
        self.process = psutil.Process(pid)
        self.peak = self.process.memory_info().rss
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.wait(0.2):
            self.peak = max(self.peak, self.process.memory_info().rss)


def test_five_fold_surge_is_survived(tmp_path: Path) -> None:
    with serve(tmp_path, FLEET) as server:
        warm = closed(server, 2 * len(MODELS), 2)  # first requests pay for lazy imports
        capacity = closed(server, 12 * len(MODELS), 6)["targets"]
        baseline = closed(server, len(MODELS), 3)["targets"]
        rss_before = psutil.Process(server.process.pid).memory_info().rss
        sampler = RssSampler(server.process.pid)
        sampler.start()
        log_start = len(server.log_records())
        rates = {m: 5 * capacity[f"/models/{m}/predict"]["throughput_rps"] for m in MODELS}
        offered = loadgen(server, *(f"--target={target(m)}" for m in MODELS), "--duration", "20", "--per-target",
                          "--rates", ",".join(f"{rates[m]:.1f}" for m in MODELS))
        surge = {m: r for m, r in zip(MODELS, report_of(offered)["targets"].values())}
        sampler.done.set()
        surge_end = time.monotonic()
        served = server_side_ok_ms(server.log_records()[log_start:])
        recovery = closed(server, len(MODELS), 3)["targets"]
        recovered_after_s = time.monotonic() - surge_end - 3
        alive = server.process.poll() is None
        rss_after = psutil.Process(server.process.pid).memory_info().rss

    figures = {
        "warm_statuses": warm["statuses"],
        "capacity_rps": {m: capacity[f"/models/{m}/predict"]["throughput_rps"] for m in MODELS},
        "offered_rps": rates,
        "surge": surge,
        "server_side_ok_p99_ms": {m: percentile(v, 0.99) for m, v in served.items()},
        "baseline_p50_ms": {m: baseline[f"/models/{m}/predict"]["ok_ms"]["p50"] for m in MODELS},
        "recovery_p50_ms": {m: recovery[f"/models/{m}/predict"]["ok_ms"]["p50"] for m in MODELS},
        "recovery_started_s_after_surge": round(recovered_after_s, 2),
        "rss_mb": {"before": rss_before >> 20, "peak": sampler.peak >> 20, "after": rss_after >> 20},
    }
    reports = REPO / "reports"
    reports.mkdir(exist_ok=True)
    (reports / "surge.json").write_text(json.dumps(figures, indent=2), encoding="utf-8")
    print("\nsurge figures:", json.dumps(figures))

    assert alive, "the server died under the surge"
    for model, result in surge.items():
        statuses = {int(s) for s in result["statuses"]}
        assert statuses <= {200, 503, 504}, f"{model}: unexpected statuses {result['statuses']}"
        assert result["errors"] == {}, f"{model}: transport errors (resets, timeouts): {result['errors']}"
        assert result["rejected_without_retry_after"] == 0
        assert result["statuses"].get("200", 0) > 0 and result["statuses"].get("503", 0) > 0
    for model in MODELS:  # served again right after the surge (the surge's admitted work may still be queued)
        statuses = recovery[f"/models/{model}/predict"]["statuses"]
        assert statuses.get("200", 0) > 0 and set(statuses) <= {"200", "503", "504"}, f"{model} after the surge: {statuses}"
    assert sampler.peak - rss_before < 300 * 2**20, "resident memory grew by more than 300 MB"
