"""What the live page shows, as one compact JSON document: the only place the page reads the router.

Everything comes from the runtime's public state (deployments' `describe()`, the device
schedulers) and the Prometheus registry's cumulative histograms; the page turns counts into
rates and windowed percentiles itself, from the difference between two polls.
"""

from __future__ import annotations

import time
from typing import Any

from prometheus_client import Counter, Histogram

from router import __version__
from router.http.metrics import BATCH_BUCKETS, LATENCY_BUCKETS, RouterMetrics
from router.serving.runtime import Runtime

__all__ = ["RESIDENCY_FIELDS", "fleet_state"]

#: Fields a dynamic fleet adds to a model's snapshot; shown when present.
RESIDENCY_FIELDS = ("residency", "loads", "evictions", "cold_starts", "last_used", "pinned")
_MODEL_FIELDS = ("name", "state", "error", "devices", "required", "requests")


def fleet_state(runtime: Runtime, metrics: RouterMetrics) -> dict[str, Any]:
    """Devices, models and cumulative histograms, at this moment."""
    latency = _buckets(metrics.answer_latency)
    queue_wait = _buckets(metrics.queue_wait)
    batch_size = _buckets(metrics.batch_size)
    within_deadline = _totals(metrics.within_deadline)
    models = []
    for name, deployment in runtime.deployments.items():
        described = deployment.describe()
        model: dict[str, Any] = {key: described.get(key) for key in _MODEL_FIELDS}
        model.update({key: described[key] for key in RESIDENCY_FIELDS if key in described})
        model["queue"] = {"depth": deployment.queue.depth, "capacity": deployment.queue.max_size,
                          "timeout_ms": deployment.config.queue.timeout_ms}
        model["batch"] = {"max_size": deployment.config.batch.max_size,
                          "effective_max_size": described["batch"]["effective_max_size"]}  # type: ignore[index]
        model["instances"] = [{"device": i.device, "state": i.state.value, "busy": i.busy, "batches": i.batches}
                              for i in deployment.instances]
        model["within_deadline"] = within_deadline.get(name, 0)
        model["histograms"] = {"latency": latency.get(name), "queue_wait": queue_wait.get(name),
                               "batch_size": batch_size.get(name)}
        models.append(model)
    return {
        "time": time.time(),
        "version": __version__,
        "ready": runtime.ready,
        "draining": runtime.draining,
        "buckets": {"latency": list(LATENCY_BUCKETS), "queue_wait": list(LATENCY_BUCKETS),
                    "batch_size": list(BATCH_BUCKETS)},
        "devices": [_device(runtime, device) for device in runtime.schedulers],
        "device_errors": dict(runtime.device_errors),
        "models": models,
    }


def _device(runtime: Runtime, device: str) -> dict[str, Any]:
    scheduler = runtime.schedulers[device]
    reading = scheduler.last_reading
    return {
        "name": device,
        "budget_bytes": scheduler.budget_bytes,
        "used_bytes": reading.used_bytes if reading else None,
        "total_bytes": reading.total_bytes if reading else scheduler.total_bytes,
        "weights_bytes": scheduler.ledger.weights_bytes,
        "reserved_bytes": scheduler.ledger.reserved_bytes,
        "peak_bytes": scheduler.ledger.peak_bytes,
        "high_watermark": scheduler.config.high_watermark,
        "low_watermark": scheduler.config.low_watermark,
        "paused": scheduler.paused,
        "running_batches": scheduler.running_batches,
        "probe_errors": scheduler.probe_errors,
        "restarts": scheduler.restarts,
    }


def _buckets(histogram: Histogram) -> dict[str, dict[str, Any]]:
    """Per model: cumulative bucket counts (one per bound, +Inf last), total count and sum."""
    out: dict[str, dict[str, Any]] = {}
    for family in histogram.collect():
        for sample in family.samples:
            entry = out.setdefault(sample.labels["model"], {"counts": [], "count": 0, "sum": 0.0})
            if sample.name.endswith("_bucket"):
                entry["counts"].append(int(sample.value))
            elif sample.name.endswith("_count"):
                entry["count"] = int(sample.value)
            elif sample.name.endswith("_sum"):
                entry["sum"] = round(sample.value, 6)
    return out


def _totals(counter: Counter) -> dict[str, int]:
    return {sample.labels["model"]: int(sample.value) for family in counter.collect()
            for sample in family.samples if sample.name.endswith("_total")}
