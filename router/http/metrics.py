"""Prometheus metrics. Event metrics (histograms, counters) are recorded as things happen; state
(queue depth, ledger, device memory) is read at scrape time from the runtime's owners.

On a host split into processes (`--workers N`) every process records its events with
prometheus_client's multiprocess mode (`PROMETHEUS_MULTIPROC_DIR`, set by the parent for all of
them), and any front's `/metrics` sums them at scrape time (`MultiProcessCollector`): the fronts'
request counters and the engine's batch histograms alike. The state gauges come once, from the
engine's snapshots through the front's façade.

In that mode prometheus_client asks the system for the process id at every increment and
observation (to notice a fork and start files of its own); a request records about ten, and the
system calls cost a front about 1% of its CPU. Here the id is read once, and again only after a fork."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import psutil
from prometheus_client import CollectorRegistry, Counter, Histogram, ProcessCollector, Summary, generate_latest, values
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import Collector

from router.errors import EngineUnavailable
from router.serving.rules import EVALUATIONS

if TYPE_CHECKING:
    from router.serving.facade import Serving

__all__ = ["CONTENT_TYPE", "RouterMetrics"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
LOADED = frozenset({"warming", "ready", "fenced", "draining"})
LOAD_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)

_pid = os.getpid()


def _process_id() -> int:
    """This process's id, as read at start or after the last fork."""
    return _pid


def _forked() -> None:
    global _pid
    _pid = os.getpid()


if os.environ.get("PROMETHEUS_MULTIPROC_DIR") and values.ValueClass is not values.MutexValue:
    # Before any metric of this process holds a value (only RouterMetrics makes them).
    os.register_at_fork(after_in_child=_forked)
    values.ValueClass = values.MultiProcessValue(_process_id)


class RouterMetrics:
    """All metrics of one runtime, in a registry of its own; or, in a process of a split host, this
    process's share of the whole server's (see the module's docstring)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.multiprocess = MultiProcessCollector(self.registry) if os.environ.get("PROMETHEUS_MULTIPROC_DIR") else None
        registry = None if self.multiprocess else self.registry  # multiprocess: recorded to files, read back summed
        self.requests = Counter(
            "model_router_requests", "Requests by model and outcome.", ["model", "outcome"], registry=registry
        )
        self.queue_wait = Histogram(
            "model_router_queue_wait_seconds", "Time from enqueue to dispatch.", ["model"],
            buckets=LATENCY_BUCKETS, registry=registry,
        )
        self.batch_size = Histogram(
            "model_router_batch_size", "Items per executed batch.", ["model"],
            buckets=BATCH_BUCKETS, registry=registry,
        )
        self.execution = Histogram(
            "model_router_batch_execution_seconds", "Wall time of one batch on its device.", ["model"],
            buckets=LATENCY_BUCKETS, registry=registry,
        )
        self.loads = Counter(
            "model_router_loads", "Model instance loads by result (ok, failed).", ["model", "device", "result"],
            registry=registry,
        )
        self.load_seconds = Histogram(
            "model_router_load_seconds", "Time to load, warm and size one instance.", ["model", "device"],
            buckets=LOAD_BUCKETS, registry=registry,
        )
        self.evictions = Counter(
            "model_router_evictions", "Instances unloaded by the residency planner or an operator, by kind "
            "(idle, lru, deadline, admin, replaced, removed).", ["model", "device", "kind"], registry=registry,
        )
        self.cold_waits = Histogram(
            "model_router_cold_start_wait_seconds", "How long a request waited for its model to load.", ["model"],
            buckets=LATENCY_BUCKETS, registry=registry,
        )
        self.request_latency = Histogram(
            "model_router_request_seconds", "End-to-end time inside the router, by model.", ["model"],
            buckets=LATENCY_BUCKETS, registry=registry,
        )
        self.answer_latency = Histogram(
            "model_router_answer_seconds", "Time inside the router of requests answered 200, by model.", ["model"],
            buckets=LATENCY_BUCKETS, registry=registry,
        )
        self.within_deadline = Counter(
            "model_router_answers_within_deadline", "Requests answered 200 within their deadline (the SLO's numerator).",
            ["model"], registry=registry,
        )
        self.mirror_requests = Counter(
            "model_router_mirror_requests", "Mirrored (shadow) copies by model and outcome (served, shed, "
            "failed, expired); never counted in model_router_requests_total.", ["model", "outcome"], registry=registry,
        )
        self.engine_messages = Counter(
            "model_router_engine_messages", "Messages the engine process received from the fronts, by kind (submit, "
            "cancel, call, lags): a refusal a front answers itself never shows here.", ["kind"], registry=registry,
        )
        self.shared_memory_inline = Counter(
            "model_router_shared_memory_inline", "Large buffers that crossed between processes inside a message "
            "because the shared-memory arena was full, by direction.", ["direction"], registry=registry,
        )
        self.rule_evaluations = Counter(
            "model_router_rule_evaluations", "Runs of the request rules in this process, by step: screen (where a "
            "request arrives, before its body is read) and commit (where it takes its queue slot); each request is "
            "screened at most once and committed once per item.", ["step"], registry=registry,
        )
        self._version_metrics(registry)
        self._children: dict[tuple[int, tuple[str, ...]], Any] = {}
        steps = {step: self.rule_evaluations.labels(step) for step in ("screen", "commit")}
        EVALUATIONS.sink = lambda step: steps[step].inc()  # this process's rules, counted where they run
        self._pipeline_metrics(registry)
        ProcessCollector(registry=self.registry)  # this process's process_cpu_seconds_total, resident memory, ...
        self.registry.register(_HostCollector())

    def _version_metrics(self, registry: CollectorRegistry | None) -> None:
        """Per routed name (a model with versions) and version: the users' answers, the agreement
        of shadow copies with them, and the items a failing version left to the stable one."""
        self.version_requests = Counter(
            "model_router_version_requests", "Requests to a model with versions, by the version routed to and outcome.",
            ["model", "version", "outcome"], registry=registry,
        )
        self.version_agreement = Summary(
            "model_router_version_agreement", "Agreement of a version's answers with another's on the same inputs "
            "(0 to 1; top-1 for classifiers, matched-box F1 for detectors, or the plugin's own).",
            ["model", "version", "against"], registry=registry,
        )
        self.version_fallbacks = Counter(
            "model_router_version_fallbacks", "Items a non-stable version failed that the stable version answered.",
            ["model"], registry=registry,
        )

    def observe_version(self, name: str, version: str, outcome: str, seconds: float) -> None:
        self._child(self.version_requests, name, version, outcome).inc()

    def observe_agreement(self, name: str, version: str, against: str, value: float) -> None:
        self._child(self.version_agreement, name, version, against).observe(value)

    def observe_fallback(self, name: str) -> None:
        self._child(self.version_fallbacks, name).inc()

    def _pipeline_metrics(self, registry: CollectorRegistry | None) -> None:
        """Per pipeline and per step (`step`: its position and name, like `2:resnet18`). A step's
        items are also requests of its model, counted in the models' metrics."""
        self.pipeline_requests = Counter(
            "model_router_pipeline_requests", "Pipeline requests by outcome.", ["pipeline", "outcome"],
            registry=registry,
        )
        self.pipeline_latency = Histogram(
            "model_router_pipeline_answer_seconds", "Time inside the router of pipeline requests answered 200.",
            ["pipeline"], buckets=LATENCY_BUCKETS, registry=registry,
        )
        self.step_items = Histogram(
            "model_router_pipeline_step_items", "Items one answered request put through the step.", ["pipeline", "step"],
            buckets=(0, *BATCH_BUCKETS), registry=registry,
        )
        self.step_seconds = Histogram(
            "model_router_pipeline_step_seconds", "Time from a step's first item in to its last answer, per request.",
            ["pipeline", "step"], buckets=LATENCY_BUCKETS, registry=registry,
        )
        self.step_batch_size = Histogram(
            "model_router_pipeline_step_batch_size", "The size of the batch each of a step's items ran in.",
            ["pipeline", "step"], buckets=BATCH_BUCKETS, registry=registry,
        )

    def observe_pipeline(self, pipeline: str, outcome: str, seconds: float) -> None:
        self.pipeline_requests.labels(pipeline, outcome).inc()
        if outcome == "ok":
            self.pipeline_latency.labels(pipeline).observe(seconds)

    def observe_step(self, pipeline: str, step: str, items: int, seconds: float, batch_sizes: list[int]) -> None:
        self.step_items.labels(pipeline, step).observe(items)
        if items:
            self.step_seconds.labels(pipeline, step).observe(seconds)
        sizes = self.step_batch_size.labels(pipeline, step)
        for size in batch_sizes:
            sizes.observe(size)

    def observe_batch(self, model: str, size: int, seconds: float) -> None:
        self._child(self.batch_size, model).observe(size)
        self._child(self.execution, model).observe(seconds)

    def _child(self, metric: Any, *labels: str) -> Any:
        """A metric's child for these label values, looked up once (`labels()` locks and checks)."""
        key = (id(metric), labels)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*labels)
        return child

    def observe_request(self, model: str, outcome: str, seconds: float) -> None:
        self._child(self.requests, model, outcome).inc()
        self._child(self.request_latency, model).observe(seconds)

    def observe_queue_wait(self, model: str, seconds: float) -> None:
        self._child(self.queue_wait, model).observe(seconds)

    def observe_mirror(self, model: str, outcome: str) -> None:
        self._child(self.mirror_requests, model, outcome).inc()

    def observe_load(self, model: str, device: str, seconds: float, ok: bool) -> None:
        self.loads.labels(model, device, "ok" if ok else "failed").inc()
        if ok:
            self.load_seconds.labels(model, device).observe(seconds)

    def observe_eviction(self, model: str, device: str, kind: str) -> None:
        self.evictions.labels(model, device, kind).inc()

    def observe_cold_wait(self, model: str, seconds: float) -> None:
        self.cold_waits.labels(model).observe(seconds)

    def observe_answer(self, model: str, seconds: float, deadline_s: float) -> None:
        self._child(self.answer_latency, model).observe(seconds)
        if seconds <= deadline_s:
            self._child(self.within_deadline, model).inc()

    def bind(self, runtime: Serving) -> None:
        """Receive the runtime's events and read its state at scrape time."""
        runtime.add_telemetry(self)
        for name in runtime.model_names():  # a ratio's numerator exists (at 0) before its first event
            self.within_deadline.labels(name)
        self.registry.register(_StateCollector(lambda: runtime))

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def family(self, metric: Counter | Histogram | Summary) -> list[Metric]:
        """A metric's families as a scrape sees them: this process's, or every process's summed."""
        if self.multiprocess is None:
            return list(metric.collect())
        name = metric._name  # the family name, as the multiprocess files key it
        return [family for family in self.multiprocess.collect() if family.name == name]

    def pipeline_counts(self) -> dict[str, dict[str, int]]:
        """Pipeline requests by pipeline and outcome, over every process."""
        counts: dict[str, dict[str, int]] = {}
        for family in self.family(self.pipeline_requests):
            for sample in family.samples:
                if sample.name.endswith("_total"):
                    pipeline = counts.setdefault(sample.labels["pipeline"], {})
                    outcome = sample.labels["outcome"]
                    pipeline[outcome] = pipeline.get(outcome, 0) + int(sample.value)
        return counts

    def request_counts(self) -> dict[str, dict[str, int]]:
        """Requests by model and outcome, over every process."""
        counts: dict[str, dict[str, int]] = {}
        for family in self.family(self.requests):
            for sample in family.samples:
                if sample.name.endswith("_total"):
                    model = counts.setdefault(sample.labels["model"], {})
                    model[sample.labels["outcome"]] = model.get(sample.labels["outcome"], 0) + int(sample.value)
        return counts


class _StateCollector(Collector):
    def __init__(self, runtime: Callable[[], Serving]) -> None:
        self._runtime = runtime

    def collect(self) -> Iterable[Metric]:
        runtime = self._runtime()
        depth = GaugeMetricFamily("model_router_queue_depth", "Requests waiting in the model's queue.", labels=["model"])
        capacity = GaugeMetricFamily("model_router_queue_capacity", "The model's queue bound.", labels=["model"])
        state = GaugeMetricFamily("model_router_model_state", "1 for the model's current state.", labels=["model", "state"])
        resident = GaugeMetricFamily("model_router_model_resident_bytes",
                                     "Weights an instance holds on its device (0 when not loaded).",
                                     labels=["model", "device"])
        try:
            models = runtime.models()
        except EngineUnavailable:  # a split host's engine away or hung: the fronts' own counters still show
            models = []
        for model in models:
            depth.add_metric([model.name], model.queue_depth)
            capacity.add_metric([model.name], model.queue_capacity)
            state.add_metric([model.name, model.state], 1)
            held: dict[str, int] = {}
            for instance in model.instances:
                memory = instance.memory if instance.state in LOADED else None
                held[instance.device] = held.get(instance.device, 0) + (memory.weights_bytes if memory else 0)
            for device, nbytes in held.items():
                resident.add_metric([model.name, device], nbytes)
        yield from (depth, capacity, state, resident)
        yield from _device_families(runtime)
        yield from _route_families(runtime)


def _device_families(runtime: Serving) -> Iterable[Metric]:
    reserved = GaugeMetricFamily("model_router_ledger_reserved_bytes", "Bytes reserved by running batches.", labels=["device"])
    weights = GaugeMetricFamily("model_router_ledger_weights_bytes", "Bytes booked for loaded weights.", labels=["device"])
    peak = GaugeMetricFamily("model_router_ledger_peak_bytes", "Highest ledger total seen.", labels=["device"])
    budget = GaugeMetricFamily("model_router_device_budget_bytes", "The device's memory budget for batch admission.",
                               labels=["device"])
    used = GaugeMetricFamily("model_router_device_memory_used_bytes", "Last probe reading: used.", labels=["device"])
    total = GaugeMetricFamily("model_router_device_memory_total_bytes", "Last probe reading: total.", labels=["device"])
    paused = GaugeMetricFamily("model_router_admission_paused",
                               "1 while batch admission is paused (memory above the high watermark, or no probe reading).",
                               labels=["device"])
    running = GaugeMetricFamily("model_router_running_batches", "Batches running on the device.", labels=["device"])
    high = GaugeMetricFamily("model_router_device_high_watermark_ratio", "Batch admission pauses above this share of the budget.",
                             labels=["device"])
    low = GaugeMetricFamily("model_router_device_low_watermark_ratio", "Batch admission resumes below this share of the budget.",
                            labels=["device"])
    probe_errors = CounterMetricFamily("model_router_probe_errors", "Failed or implausible memory probe readings.",
                                       labels=["device"])
    restarts = CounterMetricFamily("model_router_scheduler_restarts", "Restarts of the device's scheduler loop after a crash.",
                                   labels=["device"])
    for info in runtime.devices():
        if not info.available:
            continue
        device = info.name
        reserved.add_metric([device], info.reserved_bytes)
        weights.add_metric([device], info.weights_bytes)
        peak.add_metric([device], info.peak_bytes)
        budget.add_metric([device], info.budget_bytes)
        paused.add_metric([device], 1 if info.paused else 0)
        running.add_metric([device], info.running_batches)
        high.add_metric([device], info.high_watermark)
        low.add_metric([device], info.low_watermark)
        probe_errors.add_metric([device], info.probe_errors)
        restarts.add_metric([device], info.restarts)
        if info.used_bytes is not None and info.total_bytes is not None:
            used.add_metric([device], info.used_bytes)
            total.add_metric([device], info.total_bytes)
    yield from (reserved, weights, peak, budget, used, total, paused, running, high, low, probe_errors, restarts)


def _route_families(runtime: Serving) -> Iterable[Metric]:
    """Each routed name's split, and its rollout's step and decisions."""
    weight = GaugeMetricFamily("model_router_route_weight", "A version's share of its model's requests, in percent.",
                               labels=["model", "version"])
    step = GaugeMetricFamily("model_router_rollout_step", "The step a model's rollout is at (0 first); -1 when none runs.",
                             labels=["model"])
    decisions = CounterMetricFamily("model_router_rollout_decisions", "A rollout's decisions (step, promote, rollback).",
                                    labels=["model", "action"])
    for name, route in runtime.routes().items():
        for version in route.versions:
            weight.add_metric([name, version], route.weights.get(version, 0.0))
        rollout = runtime.rollout(name) or {}
        running = rollout.get("status") == "running"
        step.add_metric([name], rollout.get("step", -1) if running else -1)
        for action, count in (rollout.get("decisions") or {}).items():
            decisions.add_metric([name, action], count)
    yield from (weight, step, decisions)


class _HostCollector(Collector):
    """Host CPU time by mode (psutil), for the dashboard's host CPU panel where no node exporter runs."""

    def collect(self) -> Iterable[Metric]:
        seconds = CounterMetricFamily("model_router_host_cpu_seconds", "Host CPU time by mode, all cores.", labels=["mode"])
        for mode, value in psutil.cpu_times()._asdict().items():
            seconds.add_metric([mode], value)
        cpus = GaugeMetricFamily("model_router_host_cpus", "Logical CPUs of the host.")
        cpus.add_metric([], psutil.cpu_count() or 1)
        yield from (seconds, cpus)
