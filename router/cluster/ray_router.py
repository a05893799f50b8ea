"""Ray Serve's request router for device replicas: `rank_replicas` over the replicas' routing stats.

Ray calls `choose_replicas` for every request a deployment handle sends; the model is the
request's multiplexed model id (set by the front with `handle.options(multiplexed_model_id=...)`),
and the replicas that already refused it come in the call's `avoid` keyword. Each replica's
`record_routing_stats` (resident and loading models, free memory) reaches this router through
Ray's controller every `cluster.stats_period_s`. In between, the router remembers where it sent
a model's first request (its claim), so that the requests behind it follow that load instead of
starting others. Within the first rank Ray itself picks the replica with the fewest requests in
flight.
"""

from __future__ import annotations

import time
from collections import Counter
from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from router.cluster.reports import RouteView
from router.cluster.routing import rank_replicas

__all__ = ["ResidencyRouter"]

#: A claim lasts until reports show the model resident or loading, or this long.
CLAIM_S = 30.0


class ResidencyRouter(RequestRouter):
    """Routes to where a model is resident; loads go to the replica with the most free memory."""

    def initialize_state(self, **kwargs: Any) -> None:
        self._claims: dict[str, tuple[str, float]] = {}  # model -> (replica unique id, since)

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        if pending_request is None or not pending_request.metadata.multiplexed_model_id:
            return [candidate_replicas]
        model = pending_request.metadata.multiplexed_model_id
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        views = [RouteView.from_stats(key, r.routing_stats or {}) for key, r in by_id.items()]
        avoid = pending_request.kwargs.get("avoid") or ()
        self._prune(views)
        claimed = Counter(replica for replica, _ in self._claims.values())
        claim = self._claims[model][0] if model in self._claims else None
        ranks = rank_replicas(model, views, avoid=avoid, claim=claim, claimed=claimed)
        return [[by_id[key] for key in rank] for rank in ranks]

    def _prune(self, views: list[RouteView]) -> None:
        """Drop claims the reports now show (resident or loading somewhere), old ones, and those
        on replicas that are gone."""
        now = time.monotonic()
        present = {v.replica for v in views}
        for model, (replica, since) in list(self._claims.items()):
            seen = any(model in v.resident or model in v.loading for v in views)
            if seen or now - since > CLAIM_S or replica not in present:
                del self._claims[model]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        model = pending_request.metadata.multiplexed_model_id
        if not model or model in self._claims:
            return
        stats = self.curr_replicas.get(replica_id)
        view = RouteView.from_stats(replica_id.unique_id, stats.routing_stats if stats else {})
        if model not in view.resident and model not in view.loading:
            self._claims[model] = (replica_id.unique_id, time.monotonic())
