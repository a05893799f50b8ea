"""Several models on one device, and the thread settings: the router's figures from one run.

`models`: four ResNet18 models (the photo workload's settings) on the CPU, round-robin at
concurrency 16 on bus.jpg, against one model alone: the target is >= 0.9 of one model's
throughput. `threads`: the photo workload at concurrency 16 under each thread split (CPU pool,
torch intra-op), which is how the defaults were chosen. The variants alternate, twice each, so
that other load on the machine hits them alike. Each run also reports the server's CPU time per
answer: on a shared machine, more threads take a larger share of the cores from the neighbours,
so wall-clock throughput flatters oversubscription; answers per CPU-second do not.

    python -m benchmarks.fleets [--seconds 8] [--part models|threads]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from benchmarks.run import loadgen, server_cpu
from benchmarks.systems import serve_router
from benchmarks.workloads import REPO, WORKLOADS

__all__ = ["four_models", "thread_splits"]

CONCURRENCY = 16
THREAD_SPLITS = {"pool 2, torch 2": ("2", "2"), "pool 1, torch 2": ("1", "2"), "pool 2, torch 1": ("2", "1")}


def fleet(store: Path, count: int, device: str = "cpu", extra: str = "") -> str:
    photo = WORKLOADS["photo"]
    model = (f"    plugin: resnet\n    device: {device}\n    options: {json.dumps(photo.options)}\n"
             f"    queue: {{max_size: {photo.queue_size}}}\n"
             f"    batch: {{max_size: {photo.max_batch}, max_delay_ms: {photo.max_delay_ms}}}\n")
    models = "".join(f"  photo{i}:\n{model}" for i in range(count))
    return f"model_store: {store}\ndevices:\n  {device}: {{{extra}}}\nmodels:\n{models}"


def _throughput(store: Path, scratch: Path, count: int, seconds: float, env: dict[str, str] | None = None,
                extra: str = "") -> tuple[float, float]:
    """(answers per second, answers per CPU-second of the server) at concurrency 16, round-robin."""
    body = scratch / "bus.jpg"
    body.write_bytes(WORKLOADS["photo"].request_body())
    with serve_router(fleet(store, count, extra=extra), scratch, env_extra=env) as server:
        targets = [f"/models/photo{i}/predict=image/jpeg:@{body}" for i in range(count)]
        args = [arg for target in targets for arg in ("--target", target)]
        # Every model's first batches pay for lazy imports and first-use set-up: warm them all
        # (one model alone gets the same warming), then measure.
        closed_many(server, args, 2.0)
        with server_cpu(server) as cpu:
            report = closed_many(server, args, seconds)
        cpu_s = cpu.seconds
        answered = float(report["throughput_rps"]) * seconds
        return float(report["throughput_rps"]), round(answered / cpu_s, 2) if cpu_s > 0 else 0.0


def closed_many(server: Any, target_args: list[str], seconds: float) -> dict[str, Any]:
    """The targets round-robin at CONCURRENCY, closed loop."""
    first, rest = target_args[1], target_args[2:]
    return loadgen(server, first, *rest, "--concurrency", str(CONCURRENCY), "--duration", str(seconds), "--timeout", "15")


def four_models(store: Path, scratch: Path, seconds: float, rounds: int = 2) -> dict[str, Any]:
    """One model, then four round-robin, alternating; also four with no batch limit on the device."""
    settings = {"one": (1, ""), "four": (4, ""), "four, no device limit": (4, "max_concurrent_batches: 64")}
    runs: dict[str, list[tuple[float, float]]] = {name: [] for name in settings}
    for _ in range(rounds):
        for name, (count, extra) in settings.items():
            runs[name].append(_throughput(store, scratch, count, seconds, extra=extra))
    rps, per_cpu = _means(runs)
    return {"rps": rps, "per_cpu_s": per_cpu, "runs": runs,
            "ratio": round(rps["four"] / rps["one"], 3), "ratio_per_cpu_s": round(per_cpu["four"] / per_cpu["one"], 3),
            "ratio_no_limit": round(rps["four, no device limit"] / rps["one"], 3),
            "ratio_no_limit_per_cpu_s": round(per_cpu["four, no device limit"] / per_cpu["one"], 3)}


def _means(runs: dict[str, list[tuple[float, float]]]) -> tuple[dict[str, float], dict[str, float]]:
    rps = {name: round(sum(r for r, _ in v) / len(v), 2) for name, v in runs.items()}
    per_cpu = {name: round(sum(c for _, c in v) / len(v), 2) for name, v in runs.items()}
    return rps, per_cpu


def thread_splits(store: Path, scratch: Path, seconds: float, rounds: int = 2) -> dict[str, Any]:
    runs: dict[str, list[tuple[float, float]]] = {name: [] for name in THREAD_SPLITS}
    for _ in range(rounds):
        for name, (pool, torch_threads) in THREAD_SPLITS.items():
            env = {"MODEL_ROUTER_CPU_WORKERS": pool, "MODEL_ROUTER_TORCH_THREADS": torch_threads}
            runs[name].append(_throughput(store, scratch, 1, seconds, env))
    rps, per_cpu = _means(runs)
    return {"rps": rps, "per_cpu_s": per_cpu, "runs": runs}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--part", choices=("models", "threads"), action="append")
    parser.add_argument("--store", type=Path, default=REPO / "model_store")
    parser.add_argument("--scratch", type=Path, default=REPO / "benchmarks" / "results" / "scratch")
    args = parser.parse_args()
    args.scratch.mkdir(parents=True, exist_ok=True)
    parts = args.part or ["models", "threads"]
    out: dict[str, Any] = {}
    if "models" in parts:
        out["four_models"] = four_models(args.store.resolve(), args.scratch, args.seconds, args.rounds)
    if "threads" in parts:
        out["threads"] = thread_splits(args.store.resolve(), args.scratch, args.seconds, args.rounds)
    json.dump(out, sys.stdout, indent=1)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
