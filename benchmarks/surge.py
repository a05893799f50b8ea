"""The ResNet18 surge in rounds: 5x the router's capacity, open loop, 1 s deadline.

One round is `make bench`'s 5x point of the ResNet18 sweep (street.jpg): a fresh server warmed by
closed-loop traffic at concurrency 2, then 5x the capacity for `Plan.open_s`, each request with
X-Timeout-Ms 1000. What the device did meanwhile is read back from the server's access log (each
answer carries its batch's size and execution time): its busy share between the surge's first
batch and its last, the batches' mean size, and the 504s dropped unrun at dispatch against those
run and answered late. A surge that loses goodput either refuses too much (the device idles, its
batches shrink) or admits too much (504s); these figures tell which.

`make bench` runs three rounds against the run's measured capacity. With `--before`, two checkouts
alternate in each round (ABBA), and each round brackets each checkout's surge by its capacity
(closed loop at concurrency 16): on a fresh server just before, and on the surge's own server
just after; the round's ratio is to their mean, since on a shared machine the capacity drifts
within a minute. Summary: median, min and max of goodput within the deadline / capacity.

    python -m benchmarks.surge --before /path/to/other/checkout --rounds 3 --out benchmarks/results/surge_before_after.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import Counter
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any

from benchmarks.before_after import tree_server
from benchmarks.run import DEADLINE_S, Plan, closed, loadgen
from benchmarks.systems import Server, request_target
from benchmarks.workloads import REPO, WORKLOADS, Workload

__all__ = ["device_during", "surge_round", "surge_rounds"]

WORKLOAD = WORKLOADS["resnet18"]
MULTIPLE = 5.0
WARM_CONCURRENCY = 2  # as the sweep's open points
SATURATION = 16


def capacity(tree: Path, store: Path, scratch: Path, plan: Plan) -> float:
    """The router's throughput closed-loop at saturation, on a fresh server (as `make bench` measures it)."""
    target = request_target("router", WORKLOAD, scratch)
    with tree_server(tree, WORKLOAD, store, scratch) as server:
        closed(server, target, WARM_CONCURRENCY, plan.warm_s)
        return float(closed(server, target, SATURATION, plan.closed_s)["throughput_rps"])


def surge_round(tree: Path, store: Path, scratch: Path, plan: Plan, capacity_rps: float | None,
                after: bool = False, *, workload: Workload = WORKLOAD, fleet: str | None = None,
                counters: Callable[[Server], dict[str, float]] | None = None) -> dict[str, Any]:
    """One 5x surge on a fresh server of `tree`; the load generator's report and the device's
    figures. `capacity_rps` None: measured on the same server, closed loop at saturation after its
    warm-up, just before the surge. `after`: the same server's capacity again once the surge is
    over (on a shared machine the capacity drifts within a minute). `fleet`: another fleet file
    serving `workload` (`tree_server`'s). `counters`: figures read from the server just before
    the surge and just after it; what each grew by is reported under `counters`."""
    target = request_target("router", workload, scratch)
    with tree_server(tree, workload, store, scratch, fleet=fleet) as server:
        closed(server, target, WARM_CONCURRENCY, plan.warm_s)
        if capacity_rps is None:
            capacity_rps = float(closed(server, target, SATURATION, plan.closed_s)["throughput_rps"])
        rate = MULTIPLE * capacity_rps
        read_before = counters(server) if counters is not None else {}
        began = time.time()
        report = loadgen(server, target, "--rate", f"{rate:.2f}", "--duration", str(plan.open_s), "--timeout", "3",
                         "--header", f"X-Timeout-Ms:{int(DEADLINE_S * 1000)}")
        ended = time.time()
        grown = None if counters is None else {key: round(value - read_before.get(key, 0.0), 3)
                                               for key, value in counters(server).items()}
        later = closed(server, target, SATURATION, plan.closed_s)["throughput_rps"] if after else None
        log_path = server.log_path
    out = {"capacity_rps": capacity_rps, "offered_rps": round(rate, 2), "goodput_rps": report["goodput_rps"],
           "ratio": round(report["goodput_rps"] / capacity_rps, 3), "statuses": report["statuses"],
           "ok_ms": report["ok_ms"], "device": device_during(log_path.read_text(errors="replace"), began, ended)}
    if grown is not None:
        out["counters"] = grown
    if later is not None:  # the surge bracketed: capacity before it and after it, their mean the round's
        out |= {"capacity_after_rps": later, "capacity_mean_rps": round((capacity_rps + later) / 2, 2),
                "ratio": round(report["goodput_rps"] / ((capacity_rps + later) / 2), 3),
                "ratio_to_capacity_before": round(report["goodput_rps"] / capacity_rps, 3)}
    return out


def _wall(stamp: str) -> float:
    return datetime.strptime(stamp, "%Y-%m-%dT%H:%M:%S.%f%z").timestamp()


def device_during(log: str, began: float, ended: float) -> dict[str, Any]:
    """From a server's access log (JSON lines): what its device did between wall-clock times `began`
    and `ended`. The answers of one batch share its size and execution time; a batch ends when its
    first answer is logged."""
    batches: dict[tuple[float, int], float] = {}
    late: Counter[str] = Counter()
    timings: list[str] = []
    for line in log.splitlines():
        if '"router.access"' not in line and "batch timings" not in line:
            continue
        entry = json.loads(line)
        if entry.get("logger") != "router.access":
            timings.append(entry["message"].partition("batch timings ")[2])
            continue
        at = _wall(entry["ts"].replace("Z", "+0000"))
        if not began <= at <= ended:
            continue
        if entry.get("status") == 504:
            late["run, answered late" if "execution_ms" in entry else "dropped unrun"] += 1
        if "execution_ms" in entry:
            key = (entry["execution_ms"], entry["batch_size"])
            batches[key] = min(at, batches.get(key, at))
    if not batches:
        return {"batches": 0, "warm_up_timings": timings}
    ends = sorted((at, ms / 1000, size) for (ms, size), at in batches.items())
    span = ends[-1][0] - (ends[0][0] - ends[0][1])
    busy = sum(seconds for _, seconds, _ in ends)
    return {"batches": len(ends), "mean_batch": round(sum(size for *_, size in ends) / len(ends), 2),
            "median_batch_ms": round(statistics.median(seconds for _, seconds, _ in ends) * 1000, 1),
            "busy_share": round(min(1.0, busy / span), 3) if span > 0 else None, "504": dict(late),
            "warm_up_timings": timings}


def _spread(values: list[float]) -> dict[str, float]:
    return {"median": round(statistics.median(values), 3), "min": round(min(values), 3), "max": round(max(values), 3)}


def surge_rounds(trees: dict[str, Path], store: Path, scratch: Path, plan: Plan, rounds: int,
                 capacity_rps: float | None = None) -> dict[str, Any]:
    """`rounds` rounds of each tree's surge, alternating their order round by round. Without
    `capacity_rps`, each surge is offered 5x its own tree's capacity measured just before it, and
    its ratio is to the mean of that and its server's capacity just after it."""
    runs: dict[str, list[dict[str, Any]]] = {label: [] for label in trees}
    for round_ in range(rounds):
        order = list(trees) if round_ % 2 == 0 else list(reversed(trees))
        for label in order:
            measured = capacity_rps if capacity_rps is not None else capacity(trees[label], store, scratch, plan)
            run = {"round": round_ + 1, **surge_round(trees[label], store, scratch, plan, measured,
                                                      after=capacity_rps is None)}
            runs[label].append(run)
            print(f"[surge] resnet18 5x round {round_ + 1} {label}: {run['ratio']} of {measured} rps, "
                  f"{run['statuses']}, device {run['device']}", file=sys.stderr, flush=True)
    summary = {label: _spread([r["ratio"] for r in each]) for label, each in runs.items()}
    return {"multiple": MULTIPLE, "deadline_s": DEADLINE_S, "open_s": plan.open_s, "summary": summary, "runs": runs}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", type=Path, help="another checkout (its repository root), alternated with this one")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--store", type=Path, default=REPO / "model_store")
    parser.add_argument("--scratch", type=Path, default=REPO / "benchmarks" / "results" / "scratch" / "surge")
    parser.add_argument("--out", type=Path, help="also write the JSON here")
    args = parser.parse_args()
    args.scratch.mkdir(parents=True, exist_ok=True)
    trees = {"before": args.before.resolve(), "after": REPO} if args.before else {"router": REPO}
    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    result = {"started": started, **surge_rounds(trees, args.store.resolve(), args.scratch, Plan(), args.rounds)}
    text = json.dumps(result, indent=1)
    if args.out:
        args.out.write_text(text + "\n", encoding="utf-8")
    print(text)


if __name__ == "__main__":
    main()
