"""The split host (issue 21): one process against HTTP fronts and one engine, on a fast accelerator.

Three measurements, each contender on a fresh server, the contenders alternating round by round
(`--rounds`; medians and the spread, min to max, are reported):

- **fast**: the `fast` workload (a batch of n costs 2 + 0.05 n ms with the GIL released, batches
  of 64), closed loop at `--concurrency`: the router with `workers: 1` and `workers: 2`, LitServe
  with `num_api_servers` as its docs advise (None: one per inference worker, one here) and with 2.
- **noop**: the `noop` workload (the scripted plugin with no delay) against a bare Litestar handler
  that reads the same body (`benchmarks.bare_litestar`): what a front costs above the framework.
- **engine alone**: the engine with fake fronts over its real socket (`benchmarks.engine_alone`).
- **memory**: the RSS of each process (parent, each front, engine) of a split host serving the
  default fleet (config/fleet.yaml, its two models) with `workers: 2`, once every process is ready
  and each model has answered through the fronts; and which processes map torch. Each contender of
  the measurements above states its processes' RSS too, read once it is warm.

CPU per request comes from each process's CPU times (user + system) over the measured seconds,
divided by the answers, per role: the router's `model-router: front N`, `engine`, `parent`
(`one process` with `workers: 1`); LitServe's main process and its children; the load generator's
own (it shares the machine). From those: the projection to 16 cores (see `project`).

    python -m benchmarks.split_host --seconds 8 --store model_store --scratch /tmp/split
    python -m benchmarks.split_host --memory-only --store model_store --scratch /tmp/split
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psutil

from benchmarks.engine_alone import engine_alone
from benchmarks.systems import Server, free_port, launch
from benchmarks.workloads import HOST_WORKLOADS, REPO, Workload

__all__ = ["contender_run", "memory_by_role", "project", "split_host"]

#: A full batch of the fast workload: 64 answers in 2 + 0.05 * 64 ms, from one instance.
FAST_BATCH = 64
FAST_BATCH_S = (2.0 + 0.05 * FAST_BATCH) / 1000
#: The cores the projection is for (issue 21).
PROJECTED_CORES = 16
#: The parent supervises: its RSS target, in MB (with the default fleet).
PARENT_RSS_TARGET_MB = 150


# -- contenders ------------------------------------------------------------------------------------


@contextmanager
def contender(kind: str, workload: Workload, store: Path, scratch: Path, option: str) -> Iterator[Server]:
    """A server: `router` (option: workers), `litserve` (option: num_api_servers) or `bare`."""
    port = free_port()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    log = scratch / f"{kind}-{option}-{port}.log"
    if kind == "router":
        config = scratch / f"fleet-{workload.name}.yaml"
        config.write_text(workload.fleet_yaml(store), encoding="utf-8")
        env |= {"MODEL_ROUTER_HOST": "127.0.0.1", "MODEL_ROUTER_PORT": str(port), "MODEL_ROUTER_CONFIG": str(config),
                "MODEL_ROUTER_GRPC_PORT": "0", "MODEL_ROUTER_WORKERS": option}
        command, path, health = [sys.executable, "-m", "router", "serve"], f"/models/{workload.name}/predict", "/health/ready"
    elif kind == "litserve":
        command = [sys.executable, "-m", "benchmarks.litserve_app", "--workload", workload.name, "--port", str(port),
                   "--store", str(store), "--api-servers", option]
        path, health = "/predict", "/health"
    else:
        command, path, health = [sys.executable, "-m", "benchmarks.bare_litestar", "--port", str(port)], \
            f"/models/{workload.name}/predict", "/health/ready"
    with launch(kind, command, env, port, path, health, log, 180) as server:
        yield server


def roles(root: psutil.Process, kind: str) -> dict[int, str]:
    """Each process of a server's tree by its role."""
    found = {}
    for process in [root, *root.children(recursive=True)]:
        try:
            title = " ".join(process.cmdline())
        except psutil.Error:
            continue
        if kind == "router":
            role = title.removeprefix("model-router: ").strip("\0 ") if title.startswith("model-router: ") else "one process"
        elif kind == "litserve":
            role = "litserve main" if process.pid == root.pid else "litserve worker"
        else:
            role = "bare"
        found[process.pid] = role
    return found


def rss_by_role(pids: dict[int, str]) -> dict[str, int]:
    """Each process's resident set, in MB, by its role (`front 1`, `front 2`... one by one)."""
    out = {}
    for pid, role in pids.items():
        try:
            rss = psutil.Process(pid).memory_info().rss
        except psutil.Error:
            continue
        name = role if role not in out else f"{role} {pid}"  # LitServe's workers share a role
        out[name] = rss >> 20
    return dict(sorted(out.items()))


def own_memory_by_role(pids: dict[int, str]) -> dict[str, dict[str, int]]:
    """Each process's own memory, in MB, by its role: USS (the pages only it maps: what it adds to
    the host) and PSS (every page it maps, shared pages divided among the processes that map them).
    RSS counts a shared library's pages whole in every process that maps it; these do not."""
    out = {}
    for pid, role in pids.items():
        try:
            full = psutil.Process(pid).memory_full_info()
        except psutil.Error:
            continue
        out[role] = {"uss": full.uss >> 20, "pss": full.pss >> 20}
    return dict(sorted(out.items()))


def maps_torch(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/maps", encoding="utf-8") as maps:
            return any("/libtorch_cpu" in line for line in maps)
    except OSError:
        return False


def cpu_by_pid(pids: dict[int, str]) -> dict[int, float]:
    out = {}
    for pid in pids:
        try:
            times = psutil.Process(pid).cpu_times()
        except psutil.Error:
            continue
        out[pid] = times.user + times.system
    return out


def loadgen(server: Server, workload: Workload, scratch: Path, concurrency: int, seconds: float) -> dict[str, Any]:
    """A closed loop in its own process; its report."""
    body = scratch / f"body-{workload.name}.bin"
    body.write_bytes(workload.request_body())
    command = [sys.executable, "-m", "benchmarks.loadgen", "--url", server.url, "--target",
               f"{server.path}={workload.content_type}:@{body}", "--concurrency", str(concurrency), "--duration",
               str(seconds), "--timeout", "15"]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=seconds + 120, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"loadgen failed ({done.returncode}): {done.stderr[-2000:]}")
    return json.loads(done.stdout)  # type: ignore[no-any-return]


def contender_run(kind: str, option: str, workload: Workload, store: Path, scratch: Path, concurrency: int,
                  seconds: float, warm_s: float) -> dict[str, Any]:
    """One measured run on a fresh server: throughput, latency, statuses, CPU per answer by role."""
    with contender(kind, workload, store, scratch, option) as server:
        loadgen(server, workload, scratch, min(concurrency, 32), warm_s)
        tree = roles(psutil.Process(server.process.pid), kind)
        rss_mb = rss_by_role(tree)
        before = cpu_by_pid(tree)
        started = time.monotonic()
        children_before = os.times()
        report = loadgen(server, workload, scratch, concurrency, seconds)  # reaped: its CPU is in os.times()
        children_after = os.times()
        wall = time.monotonic() - started
        after = cpu_by_pid(tree)
    answered = max(1, report["statuses"].get("200", 0))
    cpu_us: dict[str, float] = {}
    for pid, role in tree.items():
        if pid in before and pid in after:
            key = "front" if role.startswith("front") else role
            cpu_us[key] = cpu_us.get(key, 0.0) + (after[pid] - before[pid]) * 1e6 / answered
    loadgen_s = (children_after.children_user + children_after.children_system
                 - children_before.children_user - children_before.children_system)
    return {"kind": kind, "option": option, "throughput_rps": report["throughput_rps"],
            "goodput_rps": report.get("goodput_rps", report["throughput_rps"]), "ok_ms": report["ok_ms"],
            "statuses": report["statuses"],
            "cpu_us_per_answer": {k: round(v, 1) for k, v in sorted(cpu_us.items())},
            "server_cpu_us_per_answer": round(sum(cpu_us.values()), 1),
            "loadgen_cpu_us_per_answer": round(loadgen_s * 1e6 / answered, 1),
            "server_cores": round(sum(cpu_us.values()) * answered / 1e6 / wall, 2),
            "processes": len(tree), "rss_mb": rss_mb}


def memory_by_role(store: Path, scratch: Path, workers: int = 2, answers: int = 4) -> dict[str, Any]:
    """RSS by process role of a split host serving the default fleet, once ready and once each model
    has answered `answers` photos through the fronts (their hooks loaded); which processes map torch."""
    fleet = (REPO / "config" / "fleet.yaml").read_text(encoding="utf-8")
    config = scratch / "fleet-default.yaml"
    config.write_text(fleet.replace("model_store: ../model_store", f"model_store: {store}"), encoding="utf-8")
    port = free_port()
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "MODEL_ROUTER_HOST": "127.0.0.1", "MODEL_ROUTER_PORT": str(port),
           "MODEL_ROUTER_CONFIG": str(config), "MODEL_ROUTER_GRPC_PORT": "0", "MODEL_ROUTER_WORKERS": str(workers)}
    photo = (REPO / "examples" / "street.jpg").read_bytes()
    with launch("router", [sys.executable, "-m", "router", "serve"], env, port, "/models/yolov8n/predict",
                "/health/ready", scratch / f"memory-{port}.log", 300) as server:
        fronts = {f"front {i}" for i in range(1, workers + 1)}
        while not fronts <= set(roles(psutil.Process(server.process.pid), "router").values()):
            time.sleep(0.2)
        for model in ("yolov8n", "resnet18"):
            for _ in range(answers):
                request = urllib.request.Request(f"{server.url}/models/{model}/predict", data=photo,
                                                 headers={"content-type": "image/jpeg"})
                with urllib.request.urlopen(request, timeout=60) as response:
                    response.read()
        tree = roles(psutil.Process(server.process.pid), "router")
        rss_mb = rss_by_role(tree)
        own_mb = own_memory_by_role(tree)
        torch_in = sorted(role for pid, role in tree.items() if maps_torch(pid))
    front_mb = [mb for role, mb in rss_mb.items() if role.startswith("front")]
    return {"fleet": "config/fleet.yaml", "workers": workers, "rss_mb": rss_mb, "own_mb": own_mb, "maps_torch": torch_in,
            "targets": {f"parent RSS < {PARENT_RSS_TARGET_MB} MB": rss_mb.get("parent", 1 << 30) < PARENT_RSS_TARGET_MB,
                        "each front's RSS < half the engine's": bool(front_mb) and
                        max(front_mb) < rss_mb.get("engine", 0) / 2}}


# -- the whole measurement ---------------------------------------------------------------------------


def _spread(values: list[float]) -> dict[str, float]:
    return {"median": round(statistics.median(values), 1), "min": round(min(values), 1), "max": round(max(values), 1)}


def summarise(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Median and spread of a contender's rounds."""
    out: dict[str, Any] = {"rounds": len(runs), "throughput_rps": _spread([r["throughput_rps"] for r in runs]),
                           "p50_ms": _spread([r["ok_ms"]["p50"] for r in runs]),
                           "p99_ms": _spread([r["ok_ms"]["p99"] for r in runs]),
                           "server_cpu_us_per_answer": _spread([r["server_cpu_us_per_answer"] for r in runs]),
                           "loadgen_cpu_us_per_answer": _spread([r["loadgen_cpu_us_per_answer"] for r in runs]),
                           "statuses": [r["statuses"] for r in runs]}
    for role in sorted({role for r in runs for role in r["cpu_us_per_answer"]}):
        out[f"cpu_us_per_answer[{role}]"] = _spread([r["cpu_us_per_answer"].get(role, 0.0) for r in runs])
    by_rps = sorted(runs, key=lambda r: r["throughput_rps"])
    out["median_run"] = by_rps[len(by_rps) // 2]  # for the report's table
    return out


def measure(label: str, workload: Workload, contenders: list[tuple[str, str]], store: Path, scratch: Path,
            concurrency: int, seconds: float, warm_s: float, rounds: int) -> dict[str, Any]:
    runs: dict[str, list[dict[str, Any]]] = {f"{kind} {option}": [] for kind, option in contenders}
    for round_ in range(rounds):
        order = contenders if round_ % 2 == 0 else list(reversed(contenders))
        for kind, option in order:
            run = contender_run(kind, option, workload, store, scratch, concurrency, seconds, warm_s)
            runs[f"{kind} {option}"].append(run)
            print(f"[split/{label}] round {round_} {kind} {option}: {run['throughput_rps']} rps, "
                  f"p50 {run['ok_ms']['p50']} ms, cpu/answer {run['cpu_us_per_answer']} us, {run['statuses']}",
                  file=sys.stderr, flush=True)
    return {"workload": workload.name, "concurrency": concurrency, "seconds": seconds,
            "contenders": {name: summarise(each) for name, each in runs.items()}, "runs": runs}


def project(front_us: float, engine_us: float, one_process_us: float, cores: int = PROJECTED_CORES,
            accelerator_rps: float = FAST_BATCH / FAST_BATCH_S) -> dict[str, Any]:
    """Answers a second on `cores` cores, from the measured CPU per answer: one process is held to
    one core by its GIL (its event loop does the HTTP, the rules and the batching); a split host
    with a front per core is held by whichever comes first of all cores' CPU (fronts and engine
    share them), the engine's one loop, and the accelerator (full batches back to back)."""
    one = min(1e6 / one_process_us, accelerator_rps)
    cpu_bound = cores * 1e6 / (front_us + engine_us)
    engine_bound = 1e6 / engine_us
    split = min(cpu_bound, engine_bound, accelerator_rps)
    bound = {cpu_bound: "the cores (fronts and engine)", engine_bound: "the engine's loop",
             accelerator_rps: "the accelerator"}[split]
    return {"cores": cores, "one_process_rps": round(one), "split_rps": round(split), "split_bound_by": bound,
            "ratio": round(split / one, 2), "cpu_bound_rps": round(cpu_bound), "engine_bound_rps": round(engine_bound),
            "accelerator_rps": round(accelerator_rps), "from": {"front_us": front_us, "engine_us": engine_us,
                                                               "one_process_us": one_process_us}}


def split_host(store: Path, scratch: Path, seconds: float, warm_s: float = 2.0, rounds: int = 3,
               concurrency: int = 256) -> dict[str, Any]:
    fast, noop = HOST_WORKLOADS["fast"], HOST_WORKLOADS["noop"]
    out: dict[str, Any] = {"cores": psutil.cpu_count(), "load_average_start": [round(x, 2) for x in psutil.getloadavg()]}
    out["fast"] = measure("fast", fast, [("router", "1"), ("router", "2"), ("litserve", "auto"), ("litserve", "2")],
                          store, scratch, concurrency, seconds, warm_s, rounds)
    out["noop"] = measure("noop", noop, [("router", "1"), ("router", "2"), ("bare", "-")], store, scratch, 64, seconds,
                          warm_s, rounds)
    out["engine_alone"] = [engine_alone(2, 128, seconds / 2, FAST_BATCH) for _ in range(rounds)]
    out["memory"] = memory_by_role(store, scratch)
    fast_c, noop_c = out["fast"]["contenders"], out["noop"]["contenders"]
    med = lambda table, name, key: table[name][key]["median"]
    figures = {
        "fast_w1_rps": med(fast_c, "router 1", "throughput_rps"),
        "fast_w2_rps": med(fast_c, "router 2", "throughput_rps"),
        "fast_engine_us": med(fast_c, "router 2", "cpu_us_per_answer[engine]"),
        "fast_front_us": med(fast_c, "router 2", "cpu_us_per_answer[front]"),
        "fast_one_process_us": med(fast_c, "router 1", "cpu_us_per_answer[one process]"),
        "noop_engine_us": med(noop_c, "router 2", "cpu_us_per_answer[engine]"),
        "noop_front_us": med(noop_c, "router 2", "cpu_us_per_answer[front]"),
        "noop_one_process_us": med(noop_c, "router 1", "cpu_us_per_answer[one process]"),
        "bare_us": med(noop_c, "bare -", "cpu_us_per_answer[bare]"),
        "engine_alone_us": statistics.median(r["engine_cpu_us_per_request"] for r in out["engine_alone"]),
    }
    figures["w2_over_w1"] = round(figures["fast_w2_rps"] / figures["fast_w1_rps"], 2)
    limit = FAST_BATCH / FAST_BATCH_S  # full batches back to back
    litserve = max(med(fast_c, "litserve auto", "throughput_rps"), med(fast_c, "litserve 2", "throughput_rps"))
    bare = med(noop_c, "bare -", "throughput_rps")
    for workers in ("1", "2"):
        rps = med(fast_c, f"router {workers}", "throughput_rps")
        figures[f"fast_w{workers}_over_limit"] = round(rps / limit, 3)
        figures[f"fast_w{workers}_over_litserve"] = round(rps / litserve, 2)  # LitServe's better setting
        figures[f"noop_w{workers}_over_bare"] = round(med(noop_c, f"router {workers}", "throughput_rps") / bare, 2)
    figures["front_over_bare"] = round(figures["noop_front_us"] / figures["bare_us"], 2)
    out["figures"] = figures
    out["targets"] = {
        "engine CPU per request <= 50 us (fast workload, workers 2)": figures["fast_engine_us"] <= 50,
        "engine CPU per request <= 50 us (engine alone, batches of 64)": figures["engine_alone_us"] <= 50,
        "front CPU per request <= 2x the bare Litestar handler's": figures["front_over_bare"] <= 2,
        "workers 2 >= 1.5x workers 1 on the fast accelerator": figures["w2_over_w1"] >= 1.5,
        **{f"{what} (default fleet, workers 2)": met for what, met in out["memory"]["targets"].items()},
    }
    out["projection"] = project(figures["fast_front_us"], figures["fast_engine_us"], figures["fast_one_process_us"])
    out["load_average_end"] = [round(x, 2) for x in psutil.getloadavg()]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--store", type=Path, default=REPO / "model_store")
    parser.add_argument("--scratch", type=Path, required=True)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=256)
    parser.add_argument("--memory-only", action="store_true", help="only the memory measurement, printed as JSON")
    args = parser.parse_args()
    args.scratch.mkdir(parents=True, exist_ok=True)
    if args.memory_only:
        print(json.dumps(memory_by_role(args.store.resolve(), args.scratch)))
        return
    result = split_host(args.store.resolve(), args.scratch, args.seconds, rounds=args.rounds,
                        concurrency=args.concurrency)
    summary = {k: v for k, v in result.items() if k not in ("fast", "noop")}
    summary["fast"] = {k: v for k, v in result["fast"].items() if k != "runs"}
    summary["noop"] = {k: v for k, v in result["noop"].items() if k != "runs"}
    (args.scratch / "split_host.json").write_text(json.dumps(result, indent=2), encoding="utf-8")
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
