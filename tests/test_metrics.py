"""Metric families the dashboard and the alerts need: the SLO's numerator, scheduler and probe
counters, watermarks, host and process CPU."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from dataclasses import replace
from pathlib import Path
from unittest import mock

from router.http.metrics import RouterMetrics
from tests.conftest import metric_value
from tests.test_runtime import ask, make_runtime, running


def test_only_answers_within_their_deadline_count_toward_the_slo() -> None:
    metrics = RouterMetrics()
    metrics.observe_answer("m", 0.2, 0.25)
    metrics.observe_answer("m", 0.3, 0.25)
    text = metrics.render().decode()
    assert metric_value(text, "model_router_answers_within_deadline_total", model="m") == 1
    assert metric_value(text, "model_router_answer_seconds_count", model="m") == 2


async def test_device_counters_and_host_cpu_are_exposed(tmp_path: Path) -> None:
    runtime = make_runtime(tmp_path, "models:\n  m: {plugin: scripted}\n")
    metrics = RouterMetrics()
    metrics.bind(runtime)
    async with running(runtime):
        await runtime.submit("m", ask("a"))
        [device] = runtime.devices()
        counted = replace(device, restarts=2, probe_errors=5)  # as the scheduler counts them
        with mock.patch.object(type(runtime), "devices", lambda self: [counted]):
            text = metrics.render().decode()
    assert metric_value(text, "model_router_scheduler_restarts_total", device="cpu") == 2
    assert metric_value(text, "model_router_probe_errors_total", device="cpu") == 5
    assert metric_value(text, "model_router_device_high_watermark_ratio", device="cpu") == 0.9
    assert metric_value(text, "model_router_device_low_watermark_ratio", device="cpu") == 0.8
    assert metric_value(text, "model_router_answers_within_deadline_total", model="m") == 1
    assert metric_value(text, "model_router_host_cpu_seconds_total", mode="idle") > 0
    assert metric_value(text, "model_router_host_cpus") >= 1 and metric_value(text, "process_cpu_seconds_total") > 0


FORKED = textwrap.dedent("""
    import os, sys
    from prometheus_client import values
    from router.http.metrics import RouterMetrics
    assert values.ValueClass is not values.MutexValue, "not in multiprocess mode"
    metrics = RouterMetrics()
    metrics.observe_request("m", "ok", 0.01)
    child = os.fork()
    if child == 0:  # the child records into files of its own, not over its parent's
        metrics.observe_request("m", "ok", 0.02)
        metrics.observe_request("m", "ok", 0.03)
        os._exit(0)
    os.waitpid(child, 0)
    metrics.observe_request("m", "ok", 0.04)
    [family] = metrics.family(metrics.requests)
    count = sum(s.value for s in family.samples if s.name.endswith("_total") and s.labels["outcome"] == "ok")
    files = sorted(name for name in os.listdir(os.environ["PROMETHEUS_MULTIPROC_DIR"]) if name.startswith("counter_"))
    print(int(count), len(files))
""")


def test_a_split_hosts_process_records_its_own_files_and_a_fork_starts_its_own(tmp_path: Path) -> None:
    """Multiprocess mode reads the process id once, and again after a fork: the parent's and the
    child's observations go to files of their own, and a scrape sums them all."""
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path)}
    done = subprocess.run([sys.executable, "-c", FORKED], env=env, capture_output=True, text=True, timeout=60,
                          check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["4", "2"]  # four requests, one counter file per process
