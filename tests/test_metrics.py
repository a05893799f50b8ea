"""Metric families the dashboard and the alerts need: the SLO's numerator, scheduler and probe
counters, watermarks, host and process CPU."""

from __future__ import annotations

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
