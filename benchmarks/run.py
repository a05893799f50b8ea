"""`make bench`: every contender on every workload, in one run, on this machine.

For each workload the direct loop (the limit) runs first, in its own process. Then each system
(model-router, the single-queue FastAPI pattern, LitServe) is started in its own process and
driven by `benchmarks.loadgen` in another: closed loop at saturation, and for ResNet18 an
open-loop sweep of 0.5x to 5x the router's measured capacity, each overload point on a fresh
server so one point's backlog cannot spill into the next, and the 5x point again in three rounds
(`benchmarks.surge`), and with a 100% mirror to a second version and without (`benchmarks.mirror`).
Peak RSS is sampled from the harness over the server's whole process tree. Results: benchmarks/results/latest.json, a printed
table, benchmarks/results/latest.png and, from the same results, docs/performance.md.

    python -m benchmarks.run [--quick] [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import statistics
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

from benchmarks.browser import Browser, chromium_binary
from benchmarks.performance_doc import write as write_performance_doc
from benchmarks.report import evaluate, plot, render
from benchmarks.residency import run_residency
from benchmarks.systems import SYSTEMS, RssSampler, Server, request_target, serve
from benchmarks.workloads import REPO, WORKLOADS, Workload

__all__ = ["Plan", "loadgen", "main"]

DEADLINE_S = 1.0
OPEN_MULTIPLES = (0.5, 1.0, 2.0, 5.0)
#: Workloads that run as one module in their own process (Ray's, or the gRPC/HTTP comparison): name -> module.
SCENARIOS = {"cluster": "benchmarks.cluster", "multiplex": "benchmarks.multiplex", "protocols": "benchmarks.protocols",
             "pipeline": "benchmarks.pipelines", "split": "benchmarks.split_host"}


@dataclass(frozen=True)
class Plan:
    """How long each measurement runs; `--quick` shrinks everything for a smoke run."""

    limit_s: float = 5.0
    warm_s: float = 2.0
    closed_s: float = 8.0
    open_s: float = 8.0
    multiples: tuple[float, ...] = OPEN_MULTIPLES

    @classmethod
    def quick(cls) -> Plan:
        return cls(limit_s=1.0, warm_s=0.5, closed_s=2.0, open_s=2.0, multiples=(1.0, 5.0))


def loadgen(server: Server, target: str, *args: str, timeout_s: float = 120.0) -> dict[str, Any]:
    """One load generator process against `server`; its JSON report."""
    command = [sys.executable, "-m", "benchmarks.loadgen", "--url", server.url, "--target", target,
               "--deadline", str(DEADLINE_S), *args]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=timeout_s, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"loadgen failed ({done.returncode}): {done.stderr[-2000:]}")
    return json.loads(done.stdout)  # type: ignore[no-any-return]


def closed(server: Server, target: str, concurrency: int, seconds: float) -> dict[str, Any]:
    return loadgen(server, target, "--concurrency", str(concurrency), "--duration", str(seconds), "--timeout", "15")


def direct_limit(workload: Workload, store: Path, seconds: float) -> dict[str, Any]:
    command = [sys.executable, "-m", "benchmarks.direct", "--workload", workload.name,
               "--seconds", str(seconds), "--store", str(store)]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=120, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"direct loop failed: {done.stderr[-2000:]}")
    limit: dict[str, Any] = json.loads(done.stdout)
    if "fixed_ms" in workload.extra:  # the simulated accelerator's analytic limit: max batch / batch time
        batch_s = (workload.extra["fixed_ms"] + workload.extra["per_item_ms"] * workload.max_batch) / 1000
        limit["analytic_rps"] = round(workload.max_batch / batch_s, 2)
    return limit


def closed_runs(system: str, workload: Workload, store: Path, scratch: Path, plan: Plan,
                levels: dict[str, int]) -> dict[str, Any]:
    """One server: warm it, then each closed-loop level; peak RSS over all of it."""
    target = request_target(system, workload, scratch)
    with serve(system, workload, store, scratch) as server:
        sampler = RssSampler(server.process.pid)
        sampler.start()
        closed(server, target, 2, plan.warm_s)  # first requests pay for lazy imports
        runs = {}
        for label, concurrency in levels.items():
            with server_cpu(server) as cpu:
                runs[label] = closed(server, target, concurrency, plan.closed_s)
            answered = sum(runs[label]["statuses"].values())
            runs[label]["server_cpu_ms_per_request"] = round(cpu.seconds * 1000 / max(1, answered), 3)
        return {"closed": runs, "peak_rss_mb": sampler.stop() >> 20}


class _CpuSeconds:
    seconds = 0.0


@contextmanager
def server_cpu(server: Server) -> Iterator[_CpuSeconds]:
    """The server's CPU time (user + system, all threads, and its worker processes: LitServe's
    model runs in them) spent inside the block."""
    process, spent = psutil.Process(server.process.pid), _CpuSeconds()
    before = _cpu_seconds(process)
    try:
        yield spent
    finally:
        spent.seconds = _cpu_seconds(process) - before


def open_point(system: str, workload: Workload, store: Path, scratch: Path, plan: Plan,
               rate: float, warm_concurrency: int = 2, warm_s: float | None = None) -> dict[str, Any]:
    """One open-loop rate on a fresh server, first warmed by closed-loop traffic (none when
    `warm_concurrency` is 0: the surge meets a server that has just become ready)."""
    target = request_target(system, workload, scratch)
    with serve(system, workload, store, scratch) as server:
        if warm_concurrency:
            closed(server, target, warm_concurrency, plan.warm_s if warm_s is None else warm_s)
        sampler = RssSampler(server.process.pid)
        sampler.start()
        # The deadline travels with each request (the router honours it; the peers have no such notion).
        with server_cpu(server) as cpu:
            report = loadgen(server, target, "--rate", f"{rate:.2f}", "--duration", str(plan.open_s),
                             "--timeout", "3", "--header", f"X-Timeout-Ms:{int(DEADLINE_S * 1000)}")
        report["peak_rss_mb"] = sampler.stop() >> 20
        report["server_cpu_s"] = round(cpu.seconds, 3)
        return report


def surge_points(workload: Workload, store: Path, scratch: Path, plan: Plan, capacity: float,
                 cpu_ms_per_answer: float, rounds: int = 3) -> list[dict[str, Any]]:
    """5x the router's capacity, open loop, 1 s deadline: on a server that has just become ready
    (cold), and on one warmed first by closed-loop traffic at saturation (warm); `rounds` of each,
    alternating, on a fresh server each time (one 8 s point on 2 shared cores varies by 10% and
    more; the targets take each kind's median). The server's CPU time per refusal is bounded from
    above: the surge's CPU time less `cpu_ms_per_answer` (from the closed loop at saturation) for
    each 200, over the 503s (the 504s' work is left in)."""
    points = []
    for round_ in range(rounds):
        for label, concurrency in (("cold", 0), ("warm", 16)):
            report = open_point("router", workload, store, scratch, plan, 5 * capacity, concurrency, plan.closed_s)
            refused = report["statuses"].get("503", 0)
            if refused:
                spent_ms = report["server_cpu_s"] * 1000 - cpu_ms_per_answer * report["statuses"].get("200", 0)
                report["cpu_ms_per_refusal_at_most"] = round(max(0.0, spent_ms) / refused, 3)
            points.append({"start": label, "round": round_, "multiple": 5.0, "offered_rps": round(5 * capacity, 2),
                           **report})
            print(f"[{workload.name}] router surge 5x, {label} start, round {round_}: {_brief({'': report})}",
                  flush=True)
    return points


def refusal_cost(workload: Workload, store: Path, scratch: Path, plan: Plan, concurrency: int = 8) -> dict[str, Any]:
    """The server's CPU time per 503, measured alone: the model unloaded by the operator (`POST
    /models/<name>/unload`), so every predict is refused from its headers, closed loop with the
    workload's real bodies."""
    target = request_target("router", workload, scratch)
    with serve("router", workload, store, scratch) as server:
        unload = urllib.request.Request(f"{server.url}/models/{workload.name}/unload", data=b"", method="POST")
        with urllib.request.urlopen(unload, timeout=60) as answer:
            answer.read()
        closed(server, target, 2, plan.warm_s)
        with server_cpu(server) as cpu:
            report = closed(server, target, concurrency, plan.closed_s)
    refused = report["statuses"].get("503", 0)
    return {"concurrency": concurrency, "statuses": report["statuses"], "refusals_per_s": round(refused / plan.closed_s),
            "server_cpu_ms_per_refusal": round(cpu.seconds * 1000 / max(1, refused), 3)}


def run_workload(workload: Workload, store: Path, scratch: Path, plan: Plan, sweep: bool) -> dict[str, Any]:
    levels = {"resnet18": {"saturation": 16}, "photo": {"saturation": 16}, "accelerator": {"saturation": 128},
              "tiny": {"c1": 1, "saturation": 32}}[workload.name]
    out: dict[str, Any] = {"limit": direct_limit(workload, store, plan.limit_s), "systems": {}}
    print(f"[{workload.name}] limit {out['limit']}", flush=True)
    for system in SYSTEMS:
        out["systems"][system] = closed_runs(system, workload, store, scratch, plan, levels)
        print(f"[{workload.name}] {system}: {_brief(out['systems'][system]['closed'])}", flush=True)
    if sweep:
        capacity = out["systems"]["router"]["closed"]["saturation"]["throughput_rps"]
        out["capacity_rps"] = capacity
        for system in SYSTEMS:
            points = []
            for multiple in plan.multiples:
                report = open_point(system, workload, store, scratch, plan, multiple * capacity)
                points.append({"multiple": multiple, "offered_rps": round(multiple * capacity, 2), **report})
                print(f"[{workload.name}] {system} open {multiple}x: {_brief({'': report})}", flush=True)
            out["systems"][system]["open"] = points
        if workload.name == "resnet18":  # the sweep's 5x point again, in rounds: one 8 s point varies a lot here
            from benchmarks.surge import surge_rounds  # it uses this module's load generator

            out["surge_rounds"] = surge_rounds({"router": REPO}, store, scratch, plan,
                                               rounds=1 if plan.limit_s < 2 else 3, capacity_rps=capacity)
    if workload.name == "photo":
        out["capacity_rps"] = out["systems"]["router"]["closed"]["saturation"]["throughput_rps"]
        out["surge"] = surge_points(workload, store, scratch, plan, out["capacity_rps"],
                                    out["systems"]["router"]["closed"]["saturation"]["server_cpu_ms_per_request"],
                                    rounds=1 if plan.limit_s < 2 else 3)
        out["refusal_cost"] = refusal_cost(workload, store, scratch, plan)
        print(f"[photo] refusals alone: {out['refusal_cost']}", flush=True)
        out["preprocess"] = preprocess_costs(plan)
        print(f"[photo] preprocessing, one thread: {out['preprocess']}", flush=True)
        from benchmarks.fleets import four_models  # it uses this module's load generator

        out["four_models"] = four_models(store, scratch, plan.closed_s, rounds=1 if plan.limit_s < 2 else 2)
        print(f"[photo] four models on one device: {out['four_models']['rps']}", flush=True)
    return out


def page_overhead(store: Path, scratch: Path, plan: Plan, rounds: int = 4) -> dict[str, Any]:
    """The tiny workload at saturation (the router's own work is all there is, so anything else on the
    cores shows) with the live page open in headless Chromium on the same machine, polling /ui/state
    every second, and with the same browser on a blank page. The two alternate (ABBA) on one server;
    the figures are medians of each round's ratio, since other work on the machine drifts: throughput,
    and the router's CPU time per request, which such drift disturbs less."""
    if chromium_binary() is None:
        return {"skipped": "chromium is not installed (make test-tools installs it as root)"}
    workload = WORKLOADS["tiny"]
    target = request_target("router", workload, scratch)
    rps: dict[bool, list[float]] = {False: [], True: []}
    cpu_ms: dict[bool, list[float]] = {False: [], True: []}  # router CPU per request
    page_cpu_s = 0.0
    with serve("router", workload, store, scratch) as server, Browser() as browser:
        closed(server, target, 2, plan.warm_s)
        router, chromium = psutil.Process(server.process.pid), psutil.Process(browser.pid)
        for round_ in range(rounds):
            for page_open in (False, True) if round_ % 2 == 0 else (True, False):
                browser.goto(f"{server.url}/ui" if page_open else "about:blank")
                if page_open:
                    browser.wait_for("!!document.querySelector('[data-model]')")
                before = _cpu_seconds(router), _cpu_seconds(chromium)
                report = closed(server, target, 32, plan.closed_s)
                rps[page_open].append(report["throughput_rps"])
                cpu_ms[page_open].append(round(1000 * (_cpu_seconds(router) - before[0]) / max(1, report["requests"]), 4))
                if page_open:
                    page_cpu_s += _cpu_seconds(chromium) - before[1]
    return {"workload": workload.name, "concurrency": 32, "without_rps": rps[False], "with_page_rps": rps[True],
            "ratio": _median_ratio(rps[True], rps[False]), "router_cpu_ms_per_request": cpu_ms,
            "cpu_per_request_ratio": _median_ratio(cpu_ms[True], cpu_ms[False]),
            "browser_cpu_share": round(page_cpu_s / (rounds * plan.closed_s), 3)}


def _median_ratio(numerators: list[float], denominators: list[float]) -> float:
    return round(statistics.median(a / b for a, b in zip(numerators, denominators, strict=True) if b), 3)


def _cpu_seconds(process: psutil.Process) -> float:
    """User and system CPU of a process and its children so far."""
    total = 0.0
    for each in [process, *process.children(recursive=True)]:
        try:
            times = each.cpu_times()
        except psutil.Error:
            continue
        total += times.user + times.system
    return total


def preprocess_costs(plan: Plan) -> dict[str, Any]:
    """benchmarks.preprocess in its own process (it pins torch and OpenCV to one thread)."""
    rounds = "8" if plan.limit_s < 2 else "40"
    command = [sys.executable, "-m", "benchmarks.preprocess", "--rounds", rounds]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=600, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"preprocessing benchmark failed: {done.stderr[-2000:]}")
    return json.loads(done.stdout)  # type: ignore[no-any-return]


def run_scenario(name: str, store: Path, scratch: Path, plan: Plan) -> dict[str, Any]:
    """A scenario module's JSON (the cluster on local Ray, Ray Serve's multiplexing, pipelines against a
    client chain and Ray Serve's composition)."""
    seconds = plan.closed_s * (3 if name == "pipeline" else 1)  # photos through two models: seconds each at c=16
    command = [sys.executable, "-m", SCENARIOS[name], "--seconds", str(seconds), "--store", str(store),
               "--scratch", str(scratch)]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=1200, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{name} failed ({done.returncode}): {done.stderr[-3000:]}")
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    print(f"[{name}] {json.dumps(result)[:600]}", flush=True)
    return result


def _brief(runs: dict[str, Any]) -> str:
    return "; ".join(f"{k} {r['throughput_rps']} rps p50 {r['ok_ms']['p50']} ms {r['statuses']}"
                     for k, r in runs.items())


def machine() -> dict[str, Any]:
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                   if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {"cpu": cpu, "cores": psutil.cpu_count(), "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
            "python": platform.python_version(), "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
            "os": platform.platform(), "load_average_start": [round(x, 2) for x in psutil.getloadavg()]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a short smoke run (figures not meaningful)")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    parser.add_argument("--store", type=Path, default=REPO / "model_store")
    parser.add_argument("--workload", action="append", choices=sorted([*WORKLOADS, "residency", *SCENARIOS]),
                        help="default: all")
    parser.add_argument("--skip-page", action="store_true", help="skip throughput with the live page open")
    parser.add_argument("--skip-tracing", action="store_true", help="skip the cost of tracing (benchmarks/tracing.py)")
    parser.add_argument("--skip-mirror", action="store_true",
                        help="skip the ResNet18 surge with a 100%% mirror and without (benchmarks/mirror.py)")
    args = parser.parse_args(argv)
    plan = Plan.quick() if args.quick else Plan()
    scratch = args.out / "scratch"  # fleet files, request bodies and server logs of this run only
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir(parents=True)
    started = time.monotonic()
    results: dict[str, Any] = {"machine": machine(), "command": "make bench", "plan": plan.__dict__,
                               "deadline_s": DEADLINE_S, "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                               "workloads": {}}
    for name in args.workload or [*WORKLOADS, "residency", *SCENARIOS]:
        if name in SCENARIOS:
            results["scenarios"] = {**results.get("scenarios", {}), name: run_scenario(name, args.store.resolve(),
                                                                                     scratch, plan)}
            continue
        if name == "residency":
            results["workloads"][name] = run_residency(args.store.resolve(), scratch)
            continue
        results["workloads"][name] = run_workload(WORKLOADS[name], args.store.resolve(), scratch, plan,
                                                  sweep=name == "resnet18")
    if not args.skip_page:
        results["page_overhead"] = page_overhead(args.store.resolve(), scratch, plan)
        print(f"[page] {results['page_overhead']}", flush=True)
    if not args.skip_tracing:
        from benchmarks.tracing import tracing_overhead

        results["tracing_overhead"] = tracing_overhead(scratch / "tracing", plan.closed_s, 2 if args.quick else 4,
                                                       plan.warm_s)
        print(f"[tracing] {json.dumps(results['tracing_overhead'])[:600]}", flush=True)
    if not args.skip_mirror:
        from benchmarks.mirror import mirror_rounds  # it uses this module's load generator

        results["mirror"] = mirror_rounds(args.store.resolve(), scratch, plan, rounds=1 if args.quick else 3)
        print(f"[mirror] {json.dumps(results['mirror']['summary'])}", flush=True)
    results["targets"] = evaluate(results)
    results["load_average_end"] = [round(x, 2) for x in psutil.getloadavg()]  # other work on the machine shows here
    results["wall_s"] = round(time.monotonic() - started, 1)
    stem = "quick" if args.quick else "latest"
    (args.out / f"{stem}.json").write_text(json.dumps(results, indent=2), encoding="utf-8")
    print(render(results))
    if "resnet18" in results["workloads"]:
        plot(results, args.out / f"{stem}.png")
    print(f"results: {args.out / (stem + '.json')} ({results['wall_s']} s)")
    if not args.quick and args.out.resolve() == (REPO / "benchmarks" / "results").resolve():
        print(f"page: {write_performance_doc(results)}")  # docs/performance.md follows latest.json
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
