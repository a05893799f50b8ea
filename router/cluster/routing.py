"""Which replica takes a request: a pure function from the replicas' views to ranked choices.

1. Replicas where the model is resident, as one rank: Ray's router takes the one with the
   shortest queue among them (its own count of requests in flight, fresher than any report).
2. Replicas loading it, or the one this router already sent a first request to (its claim):
   requests follow the load that is under way, so a burst of first requests starts one load.
3. The others, fewest loads under way first (reported, or claimed by this router), then most
   free memory, each a rank of its own: the first loads it (evicting least recently used models
   there when it must). Counting loads under way spreads a burst of first requests for several
   models over the replicas before their reports show any of it; ties go to the lower replica
   id, so that routers that have not seen each other's claims still agree.

Replicas that refused this request (`avoid`) or are draining come last, and only when nothing
else is left, so a request is never stuck with no candidate.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence

from router.cluster.reports import RouteView

__all__ = ["rank_replicas"]


def rank_replicas(
    model: str, replicas: Sequence[RouteView], *, avoid: Collection[str] = (), claim: str | None = None,
    claimed: Mapping[str, int] | None = None,
) -> list[list[str]]:
    """Replica ids in ranks, most preferred first. `claim`: the replica this router sent the
    model's first request to; `claimed`: per replica, the loads this router started there that
    its reports do not show yet."""
    claimed = claimed or {}
    usable = [r for r in replicas if r.replica not in avoid and not r.draining]
    ranks: list[list[str]] = []
    resident = sorted(r.replica for r in usable if model in r.resident)
    if resident:
        ranks.append(resident)
    loading = [r for r in usable if model not in r.resident and (model in r.loading or r.replica == claim)]
    if loading:
        ranks.append(sorted(r.replica for r in loading))
    taken = set(resident) | {r.replica for r in loading}
    rest = sorted((r for r in usable if r.replica not in taken),
                  key=lambda r: (len(r.loading) + claimed.get(r.replica, 0), -r.free_bytes, r.replica))
    ranks += [[r.replica] for r in rest]
    leftovers = sorted(r.replica for r in replicas if r.replica in avoid or r.draining)
    if leftovers:
        ranks.append(leftovers)
    return ranks
