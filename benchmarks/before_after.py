"""The existing workloads on two checkouts of the router, side by side: a change must not cost them.

For each workload (resnet18, photo, accelerator, tiny), `--rounds` rounds; in each, the router of
`--before` (another checkout, e.g. a `git worktree` of main) and of this tree, in alternating order,
each on a fresh server with its default settings, warmed, then a closed loop at the workload's
saturation concurrency (as `make bench` measures it). Both use this tree's virtual environment;
`--before`'s own router, plugins and test kit come first on its PYTHONPATH. Reported: medians and
the spread (min to max) of throughput, p50, p99 and the server's CPU per request.

    git worktree add /tmp/before main
    python -m benchmarks.before_after --before /tmp/before --rounds 3 --seconds 8
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from benchmarks.run import Plan, _cpu_seconds, closed
from benchmarks.systems import Server, free_port, launch, request_target
from benchmarks.workloads import REPO, WORKLOADS, Workload

__all__ = ["before_after", "tree_server"]

#: The saturation concurrency of each workload, as benchmarks/run.py measures it.
SATURATION = {"resnet18": 16, "photo": 16, "accelerator": 128, "tiny": 32}
PLUGIN_DIRS = ("tests/plugin_dist", "plugins/resnet", "plugins/yolo", "plugins/engines", "plugins/onnx",
               "plugins/tensorrt", "examples/plugin-mean-colour")


@contextmanager
def tree_server(tree: Path, workload: Workload, store: Path, scratch: Path,
                workers: str | None = None, fleet: str | None = None) -> Iterator[Server]:
    """The router of checkout `tree` serving `workload` with its default settings, on a fresh port:
    this tree's virtual environment, `tree`'s router, plugins and test kit first on its PYTHONPATH.
    `fleet`: the text of another fleet file that serves `workload` (default: its one-model fleet)."""
    port = free_port()
    config = scratch / (f"fleet-{workload.name}.yaml" if fleet is None else f"fleet-{workload.name}-{port}.yaml")
    config.write_text(workload.fleet_yaml(store) if fleet is None else fleet, encoding="utf-8")
    path = os.pathsep.join(str(tree / d) for d in ("", *PLUGIN_DIRS))
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": path, "MODEL_ROUTER_HOST": "127.0.0.1",
           "MODEL_ROUTER_PORT": str(port), "MODEL_ROUTER_CONFIG": str(config), "MODEL_ROUTER_GRPC_PORT": "0"}
    env.pop("MODEL_ROUTER_WORKERS", None)  # the default setting, unless asked for another
    if workers is not None:
        env["MODEL_ROUTER_WORKERS"] = workers
    with launch("router", [sys.executable, "-m", "router", "serve"], env, port, f"/models/{workload.name}/predict",
                "/health/ready", scratch / f"router-{tree.name}-{port}.log", 300, cwd=tree) as server:
        yield server


def run_once(tree: Path, workload: Workload, store: Path, scratch: Path, seconds: float, warm_s: float,
             workers: str | None = None) -> dict[str, Any]:
    import psutil

    target = request_target("router", workload, scratch)
    with tree_server(tree, workload, store, scratch, workers) as server:
        closed(server, target, 2, warm_s)
        process = psutil.Process(server.process.pid)
        before = _cpu_seconds(process)
        report = closed(server, target, SATURATION[workload.name], seconds)
        spent = _cpu_seconds(process) - before
    answered = max(1, report["statuses"].get("200", 0))
    return {"throughput_rps": report["throughput_rps"], "p50_ms": report["ok_ms"]["p50"], "p99_ms": report["ok_ms"]["p99"],
            "cpu_ms_per_request": round(spent * 1000 / answered, 3), "statuses": report["statuses"]}


def _spread(values: list[float]) -> dict[str, float]:
    return {"median": round(statistics.median(values), 3), "min": round(min(values), 3), "max": round(max(values), 3)}


def before_after(before: Path, workloads: list[str], store: Path, scratch: Path, rounds: int, seconds: float,
                 warm_s: float, after_workers: str | None = None) -> dict[str, Any]:
    trees = {"before": before.resolve(), "after": REPO}
    out: dict[str, Any] = {}
    for name in workloads:
        runs: dict[str, list[dict[str, Any]]] = {"before": [], "after": []}
        for round_ in range(rounds):
            for label in ("before", "after") if round_ % 2 == 0 else ("after", "before"):
                run = run_once(trees[label], WORKLOADS[name], store, scratch, seconds, warm_s,
                               after_workers if label == "after" else None)
                runs[label].append(run)
                print(f"[before/after] {name} round {round_} {label}: {run}", file=sys.stderr, flush=True)
        summary = {label: {key: _spread([r[key] for r in each]) for key in ("throughput_rps", "p50_ms", "p99_ms",
                                                                               "cpu_ms_per_request")}
                   for label, each in runs.items()}
        summary["after_over_before"] = {
            "throughput": round(summary["after"]["throughput_rps"]["median"] / summary["before"]["throughput_rps"]["median"], 3),
            "cpu_per_request": round(summary["after"]["cpu_ms_per_request"]["median"]
                                     / summary["before"]["cpu_ms_per_request"]["median"], 3)}
        out[name] = {"summary": summary, "runs": runs}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", type=Path, required=True, help="the other checkout (its repository root)")
    parser.add_argument("--workload", action="append", choices=sorted(SATURATION), help="default: all four")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--after-workers", help="MODEL_ROUTER_WORKERS for this tree (default: the default setting)")
    parser.add_argument("--seconds", type=float, default=Plan.closed_s)
    parser.add_argument("--store", type=Path, default=REPO / "model_store")
    parser.add_argument("--scratch", type=Path, default=REPO / "benchmarks" / "results" / "scratch" / "before_after")
    args = parser.parse_args()
    args.scratch.mkdir(parents=True, exist_ok=True)
    result = before_after(args.before, args.workload or list(SATURATION), args.store.resolve(), args.scratch,
                          args.rounds, args.seconds, Plan.warm_s, args.after_workers)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
