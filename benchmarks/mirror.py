"""What a 100% mirror costs the stable version: ResNet18's 5x surge with the mirror on and off.

Both arms serve the same fleet, so they hold the same memory: `resnet18` with version "1" (the
demo weights, stable, all of the traffic) and version "2" (a differently seeded ResNet-18,
`resnet18-b.pt`); the mirrored arm adds `mirror: {version: "2", percent: 100}`, and that is the
only difference. Each round runs one surge of each arm, alternating their order (ABBA), each on a
fresh server (`benchmarks.surge.surge_round`): warmed at concurrency 2, its capacity closed loop at
concurrency 16, 5x that open loop for `Plan.open_s` with a 1 s deadline (X-Timeout-Ms), then its
capacity again; an arm's ratio is its goodput within the deadline over the mean of the two
capacities. The server's /metrics are read just before the surge and just after it, each time once
the server is idle (`server_counters`): the mirror's copies by outcome
(`model_router_mirror_requests_total`, counted by the deployment that ran them, `resnet18@2`) and
the answers by version (`model_router_version_requests_total`).

The target: the mirrored arm's ratio over the unmirrored arm's, at least 0.95 at the median of
the rounds and in each. Copies are submitted after their user's answer and admitted only while no
real request waits on the device, so during a surge they should be shed, not served.

    python -m benchmarks.mirror --rounds 3 --out benchmarks/results/mirror_rounds.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import psutil
from prometheus_client.parser import text_string_to_metric_families

from benchmarks.run import DEADLINE_S, Plan
from benchmarks.surge import MULTIPLE, WORKLOAD, surge_round
from benchmarks.systems import Server
from benchmarks.workloads import REPO, Workload

__all__ = ["TARGET", "mirror_rounds", "server_counters", "versions_fleet"]

TARGET = 0.95
ARMS = ("without", "with")
#: Version "2" of the ResNet18 workload: its keys merged over the model's (docs/rollouts.md).
SECOND = '{options: {weights: resnet18-b.pt}}'
COUNTED = {"model_router_mirror_requests": "mirror", "model_router_version_requests": "version"}
BUSY = ("model_router_queue_depth", "model_router_running_batches")  # gauges: nonzero while work is left


def versions_fleet(workload: Workload, store: Path, second: str, mirror: bool) -> str:
    """`workload`'s one-model fleet with versions "1" (as it is; stable, all the traffic) and "2"
    (`second`, a YAML flow mapping merged over the model's keys), mirrored to "2" at 100% or not."""
    fleet = workload.fleet_yaml(store)
    fleet += ("    versions:\n"
              '      "1": {}\n'
              f'      "2": {second}\n'
              '    stable: "1"\n'
              '    traffic: {"1": 100}\n')
    if mirror:
        fleet += '    mirror: {version: "2", percent: 100}\n'
    return fleet


def server_counters(server: Server, poll_s: float = 0.2, at_most_s: float = 20.0) -> dict[str, float]:
    """The mirror's copies and the answers by version, from the server's /metrics (`mirror <model>
    <outcome>` and `version <model> <version> <outcome>`), once the server is idle: nothing queued on
    any model and no batch running, at two readings in a row. A copy is submitted after its user's
    answer, and a closed loop leaves copies queued (taken in the instants between its batches), which
    run once it ends: they are counted before the surge, not in it, and both arms' surges meet an
    idle device."""
    deadline, quiet = time.monotonic() + at_most_s, 0
    while True:
        counted, busy = _read_counters(server)
        quiet = 0 if busy else quiet + 1
        if quiet >= 2 or time.monotonic() > deadline:
            return counted
        time.sleep(poll_s)


def _read_counters(server: Server) -> tuple[dict[str, float], bool]:
    """The counters, and whether anything is queued or running."""
    with urllib.request.urlopen(f"{server.url}/metrics", timeout=10) as answer:
        text = answer.read().decode()
    out: dict[str, float] = {}
    busy = False
    for family in text_string_to_metric_families(text):
        if family.name in BUSY:
            busy = busy or any(sample.value > 0 for sample in family.samples)
        kind = COUNTED.get(family.name)
        if kind is None:
            continue
        for sample in family.samples:
            if not sample.name.endswith("_total"):
                continue
            labels = sample.labels
            key = [kind, labels["model"], *([labels["version"]] if kind == "version" else []), labels["outcome"]]
            out[" ".join(key)] = sample.value
    return out, busy


def _figures(counters: dict[str, float]) -> dict[str, Any]:
    """The counters' growth over a surge, nested: copies by deployment and outcome, answers by
    version. `admitted`, where the server does not count it, is the copies that ran or expired in
    the queue (served, failed, expired); one queued and then crowded out by a real request is shed."""
    mirror: dict[str, dict[str, int]] = {}
    versions: dict[str, dict[str, int]] = {}
    for key, value in sorted(counters.items()):
        kind, *labels = key.split(" ")
        if kind == "mirror":
            mirror.setdefault(labels[0], {})[labels[1]] = int(value)
        else:
            versions.setdefault(f"{labels[0]}@{labels[1]}", {})[labels[2]] = int(value)
    for outcomes in mirror.values():
        outcomes.setdefault("admitted", sum(outcomes.get(k, 0) for k in ("served", "failed", "expired")))
    return {"copies": mirror, "answers_by_version": versions}


def _arm(store: Path, scratch: Path, plan: Plan, workload: Workload, second: str, mirrored: bool,
         tree: Path) -> dict[str, Any]:
    run = surge_round(tree, store, scratch, plan, None, after=True, workload=workload,
                      fleet=versions_fleet(workload, store, second, mirrored), counters=server_counters)
    counters = run.pop("counters")
    return {**run, **_figures(counters)}


def _spread(values: list[float]) -> dict[str, float]:
    return {"median": round(statistics.median(values), 3), "min": round(min(values), 3), "max": round(max(values), 3)}


def mirror_rounds(store: Path, scratch: Path, plan: Plan, rounds: int, *, workload: Workload = WORKLOAD,
                  second: str = SECOND, tree: Path = REPO) -> dict[str, Any]:
    """`rounds` rounds of both arms' surges, their order alternating round by round (ABBA)."""
    runs: list[dict[str, Any]] = []
    for round_ in range(rounds):
        order = ARMS if round_ % 2 == 0 else ARMS[::-1]
        arms = {arm: _arm(store, scratch, plan, workload, second, arm == "with", tree) for arm in order}
        with_, without = arms["with"], arms["without"]
        run = {"round": round_ + 1, "order": list(order), **arms,
               "ratio": round(with_["ratio"] / without["ratio"], 3) if without["ratio"] else None,
               "goodput_ratio": (round(with_["goodput_rps"] / without["goodput_rps"], 3)
                                 if without["goodput_rps"] else None)}
        runs.append(run)
        print(f"[mirror] {workload.name} 5x round {round_ + 1}: with / without {run['ratio']} "
              f"({with_['ratio']} / {without['ratio']} of capacity; goodput {with_['goodput_rps']} / "
              f"{without['goodput_rps']} rps); copies {with_['copies']}", file=sys.stderr, flush=True)
    return {"workload": workload.name, "multiple": MULTIPLE, "deadline_s": DEADLINE_S, "open_s": plan.open_s,
            "target": TARGET, "summary": _summary(runs), "runs": runs}


def _summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    ratios = [r["ratio"] for r in runs if r["ratio"] is not None]
    goodput = [r["goodput_ratio"] for r in runs if r["goodput_ratio"] is not None]
    copies: dict[str, int] = {}
    for run in runs:
        for outcomes in run["with"]["copies"].values():
            for outcome, n in outcomes.items():
                copies[outcome] = copies.get(outcome, 0) + n
    summary: dict[str, Any] = {
        "ratio": _spread(ratios) if ratios else None,
        "goodput_ratio": _spread(goodput) if goodput else None,
        **{f"{arm}_ratio": _spread([r[arm]["ratio"] for r in runs]) for arm in ARMS},
        "copies_during_surges": copies,
    }
    summary["met"] = bool(ratios) and summary["ratio"]["median"] >= TARGET and min(ratios) >= TARGET
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="short points (figures mean little)")
    parser.add_argument("--store", type=Path, default=REPO / "model_store")
    parser.add_argument("--scratch", type=Path, default=REPO / "benchmarks" / "results" / "scratch" / "mirror")
    parser.add_argument("--out", type=Path, help="also write the JSON here")
    args = parser.parse_args()
    args.scratch.mkdir(parents=True, exist_ok=True)
    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    plan = Plan.quick() if args.quick else Plan()
    load = [round(x, 2) for x in psutil.getloadavg()]
    result = {"started": started, "load_average_start": load,
              **mirror_rounds(args.store.resolve(), args.scratch, plan, args.rounds),
              "load_average_end": [round(x, 2) for x in psutil.getloadavg()]}
    text = json.dumps(result, indent=1)
    if args.out:
        args.out.write_text(text + "\n", encoding="utf-8")
    print(text)


if __name__ == "__main__":
    main()
