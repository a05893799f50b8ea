"""`/metrics` of a cluster front: aggregated and per replica, in one scrape.

- The front's own `RouterMetrics`, bound to `ClusterRuntime`: requests and their latency as
  clients saw them, queue depth and capacity per model summed over replicas, and every replica's
  device gauges (ledger, budget, memory) with `device="REPLICA/DEVICE"`.
- `model_router_cluster_*`: replicas up per node type, copies per model, where each model is
  resident, free memory per replica, requests that waited for a load, refusals retried.
- `model_router_replica_*`: every replica's own metrics (batches, loads, evictions, cold-start
  waits, ...) as it renders them, with a `replica` label, from its latest report.
"""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

from router.cluster.front import ClusterRuntime
from router.cluster.reports import ReplicaReport
from router.http.metrics import RouterMetrics
from router.serving.facade import Serving

__all__ = ["ClusterMetrics"]

PREFIX = "model_router_"
REPLICA_PREFIX = "model_router_replica_"


class ClusterMetrics(RouterMetrics):
    def bind_cluster(self, serving: Serving[ClusterRuntime]) -> None:
        """Bind as `RouterMetrics.bind`, plus the cluster's and the replicas' families."""
        self.bind(serving)
        self.registry.register(_ClusterCollector(serving.core))


class _ClusterCollector(Collector):
    def __init__(self, runtime: ClusterRuntime) -> None:
        self._runtime = runtime

    def collect(self) -> Iterable[Metric]:
        runtime = self._runtime
        reports = runtime.reports
        replicas = GaugeMetricFamily("model_router_cluster_replicas", "Device replicas reporting, by node type.",
                                     labels=["node_type"])
        for node_type in runtime.cluster.node_types:
            replicas.add_metric([node_type], sum(1 for r in reports if r.node_type == node_type))
        copies = GaugeMetricFamily("model_router_cluster_model_copies", "Replicas where the model is resident.",
                                   labels=["model"])
        resident = GaugeMetricFamily("model_router_cluster_model_resident",
                                     "1 where the model is resident, 0.5 where it is loading.", labels=["model", "replica"])
        cold = CounterMetricFamily("model_router_cluster_cold_requests", "Requests that waited for their model to load.",
                                   labels=["model"])
        retries = CounterMetricFamily("model_router_cluster_retries",
                                      "Refusals (queue full, deadline, no room) retried on another replica.",
                                      labels=["model"])
        for model in runtime.fleet.models:
            copies.add_metric([model], sum(1 for r in reports if r.loads.get(model) and r.loads[model].resident))
            cold.add_metric([model], runtime.cold[model])
            retries.add_metric([model], runtime.retries[model])
        free = GaugeMetricFamily("model_router_cluster_free_bytes", "Budget left on the replica's device.",
                                 labels=["replica", "node_type"])
        for r in reports:
            free.add_metric([r.replica, r.node_type], r.free_bytes)
            for model, load in r.loads.items():
                if load.resident or load.loading:
                    resident.add_metric([model, r.replica], 1.0 if load.resident else 0.5)
        yield from (replicas, copies, resident, cold, retries, free)
        yield from replica_families(reports)


def replica_families(reports: list[ReplicaReport]) -> Iterable[Metric]:
    """Every replica's own metrics, renamed `model_router_replica_*` and labelled with the replica."""
    merged: dict[str, Metric] = {}
    for report in reports:
        if not report.metrics_text:
            continue
        for family in text_string_to_metric_families(report.metrics_text):
            if not family.name.startswith(PREFIX):
                continue
            name = REPLICA_PREFIX + family.name.removeprefix(PREFIX)
            target = merged.setdefault(name, Metric(name, family.documentation, family.type))
            for sample in family.samples:
                target.add_sample(REPLICA_PREFIX + sample.name.removeprefix(PREFIX),
                                  {**sample.labels, "replica": report.replica}, sample.value)
    return merged.values()
