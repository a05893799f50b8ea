"""What the live page shows, as one compact JSON document: the only place the page reads the router.

Everything comes from the runtime's snapshots (`models()`, `devices()`, `routes()`), the pipeline runner's and the
Prometheus registry's cumulative histograms and counters; the page turns counts into rates and windowed
percentiles itself, from the difference between two polls.
"""

from __future__ import annotations

import time
from typing import Any

from prometheus_client.core import Metric

from router import __version__
from router.http.metrics import BATCH_BUCKETS, LATENCY_BUCKETS, RouterMetrics
from router.pipelines import PipelineRunner
from router.serving.facade import Serving
from router.serving.snapshots import DeviceInfo
from router.serving.versions import split_name

__all__ = ["RESIDENCY_FIELDS", "fleet_state", "route_states"]

#: Fields a dynamic fleet adds to a model's snapshot; shown when present.
RESIDENCY_FIELDS = ("residency",)
_MODEL_FIELDS = ("name", "state", "error", "devices", "required", "requests")


def fleet_state(runtime: Serving, metrics: RouterMetrics, pipelines: PipelineRunner | None = None) -> dict[str, Any]:
    """Devices, models, pipelines and cumulative histograms (of every process of a split host), at this moment."""
    latency = _buckets(metrics.family(metrics.answer_latency))
    queue_wait = _buckets(metrics.family(metrics.queue_wait))
    batch_size = _buckets(metrics.family(metrics.batch_size))
    within_deadline = _totals(metrics.family(metrics.within_deadline))
    models = []
    for info in runtime.models():
        described = info.as_dict()
        name = info.name
        model: dict[str, Any] = {key: described.get(key) for key in _MODEL_FIELDS}
        model.update({key: described[key] for key in RESIDENCY_FIELDS if described.get(key) is not None})
        model["queue"] = {"depth": info.queue_depth, "capacity": info.queue_capacity, "timeout_ms": info.queue_timeout_ms}
        model["batch"] = {"max_size": info.batch_max_size, "effective_max_size": described["batch"]["effective_max_size"]}
        model["instances"] = [{"device": i.device, "state": i.state, "busy": i.busy, "batches": i.batches}
                              for i in info.instances]
        model["within_deadline"] = within_deadline.get(name, 0)
        model["histograms"] = {"latency": latency.get(name), "queue_wait": queue_wait.get(name),
                               "batch_size": batch_size.get(name)}
        models.append(model)
    devices = runtime.devices()
    return {
        "time": time.time(),
        "version": __version__,
        "ready": runtime.ready,
        "draining": runtime.draining,
        "buckets": {"latency": list(LATENCY_BUCKETS), "queue_wait": list(LATENCY_BUCKETS),
                    "batch_size": list(BATCH_BUCKETS)},
        "devices": [_device(device) for device in devices if device.available],
        "device_errors": {device.name: device.error for device in devices if not device.available},
        "models": models,
        "pipelines": [] if pipelines is None else pipeline_states(pipelines, metrics),
        "routes": route_states(runtime, metrics),
    }


def route_states(runtime: Serving, metrics: RouterMetrics) -> list[dict[str, Any]]:
    """Each model with versions: its split, stable and mirror versions, its rollout, and per version
    the answers by outcome, the agreement sums by the version compared with, and the shadow copies it
    ran by outcome (totals over every process: the page takes differences between polls)."""
    requests = _labelled(metrics, "version_requests", ("model", "version", "outcome"), "_total")
    compared = _labelled(metrics, "version_agreement", ("model", "version", "against"), "_count")
    summed = _labelled(metrics, "version_agreement", ("model", "version", "against"), "_sum")
    shadows: dict[tuple[str, str | None], dict[str, int]] = {}  # by the deployment that ran them
    for (deployment, outcome), n in _labelled(metrics, "mirror_requests", ("model", "outcome"), "_total").items():
        shadows.setdefault(split_name(deployment), {})[outcome] = int(n)
    out = []
    for name, route in runtime.routes().items():
        versions = []
        for version in route.versions:
            agreement = {against: {"count": int(n), "sum": round(summed.get((m, v, against), 0.0), 6)}
                         for (m, v, against), n in compared.items() if (m, v) == (name, version)}
            versions.append({
                "version": version, "deployment": route.deployment(version), "weight": route.weights.get(version, 0.0),
                "stable": version == route.stable, "mirror": version == route.mirror,
                "requests": {outcome: int(n) for (m, v, outcome), n in requests.items() if (m, v) == (name, version)},
                "agreement": agreement, "shadow": shadows.get((name, version), {}),
            })
        shadow: dict[str, int] = {}
        for (routed, _), counts in shadows.items():
            if routed == name:
                for outcome, n in counts.items():
                    shadow[outcome] = shadow.get(outcome, 0) + n
        out.append({"name": name, "stable": route.stable, "weights": dict(route.weights),
                    "mirror": {"version": route.mirror, "percent": route.mirror_percent} if route.mirror else None,
                    "generation": route.generation, "rollout": runtime.rollout(name), "shadow": shadow,
                    "versions": versions})
    return out


def _labelled(metrics: RouterMetrics, attribute: str, labels: tuple[str, ...], suffix: str) -> dict[tuple[str, ...], float]:
    """The samples ending in `suffix` of the metric `metrics.<attribute>`, summed by `labels`; empty
    when this router has no such metric."""
    metric = getattr(metrics, attribute, None)
    out: dict[tuple[str, ...], float] = {}
    if metric is None:
        return out
    for family in metrics.family(metric):
        for sample in family.samples:
            if sample.name.endswith(suffix) and all(label in sample.labels for label in labels):
                key = tuple(sample.labels[label] for label in labels)
                out[key] = out.get(key, 0.0) + sample.value
    return out


def pipeline_states(pipelines: PipelineRunner, metrics: RouterMetrics) -> list[dict[str, Any]]:
    """Each pipeline: its chain, state, outcomes, its 200s' latency histogram, and per step the
    items and batch sizes so far (totals: the page takes differences between polls)."""
    latency = _buckets(metrics.family(metrics.pipeline_latency), "pipeline")
    items, sizes = _sums(metrics.family(metrics.step_items)), _sums(metrics.family(metrics.step_batch_size))
    out = []
    for info in pipelines.infos():
        steps = [{"step": key, "items": items[(info.name, key)], "batch_sizes": sizes.get((info.name, key))}
                 for (name, key) in items if name == info.name]
        out.append({"name": info.name, "state": info.state, "error": info.error, "requests": dict(info.requests),
                    "chain": " → ".join(next(iter(step.values())) for step in info.steps),
                    "histograms": {"latency": latency.get(info.name)}, "steps": steps})
    return out


def _sums(families: list[Metric]) -> dict[tuple[str, str], dict[str, float]]:
    """Per (pipeline, step): how many observations and their sum."""
    out: dict[tuple[str, str], dict[str, float]] = {}
    for family in families:
        for sample in family.samples:
            entry = out.setdefault((sample.labels["pipeline"], sample.labels["step"]), {"count": 0, "sum": 0.0})
            if sample.name.endswith("_count"):
                entry["count"] = int(sample.value)
            elif sample.name.endswith("_sum"):
                entry["sum"] = round(sample.value, 6)
    return out


def _device(device: DeviceInfo) -> dict[str, Any]:
    return {
        "name": device.name,
        "budget_bytes": device.budget_bytes,
        "used_bytes": device.used_bytes,
        "total_bytes": device.total_bytes,
        "weights_bytes": device.weights_bytes,
        "reserved_bytes": device.reserved_bytes,
        "peak_bytes": device.peak_bytes,
        "high_watermark": device.high_watermark,
        "low_watermark": device.low_watermark,
        "paused": device.paused,
        "running_batches": device.running_batches,
        "probe_errors": device.probe_errors,
        "restarts": device.restarts,
    }


def _buckets(families: list[Metric], label: str = "model") -> dict[str, dict[str, Any]]:
    """Per model (or pipeline): cumulative bucket counts (one per bound, +Inf last), total count and sum."""
    out: dict[str, dict[str, Any]] = {}
    for family in families:
        for sample in sorted(family.samples, key=_bucket_order):
            entry = out.setdefault(sample.labels[label], {"counts": [], "count": 0, "sum": 0.0})
            if sample.name.endswith("_bucket"):
                entry["counts"].append(int(sample.value))
            elif sample.name.endswith("_count"):
                entry["count"] = int(sample.value)
            elif sample.name.endswith("_sum"):
                entry["sum"] = round(sample.value, 6)
    return out


def _bucket_order(sample: Any) -> float:
    """Buckets by their bound (the multiprocess collector does not keep their order); others after."""
    bound = sample.labels.get("le")
    return float("inf") if bound in (None, "+Inf") else float(bound)


def _totals(families: list[Metric]) -> dict[str, int]:
    return {sample.labels["model"]: int(sample.value) for family in families
            for sample in family.samples if sample.name.endswith("_total")}
