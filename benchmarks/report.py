"""Turn a benchmark run's JSON into the target ratios, a short table and the plot."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

__all__ = ["evaluate", "plot", "render"]


def _target(name: str, measured: float | None, target: float, *, at_most: bool = False,
            detail: str = "") -> dict[str, Any]:
    if measured is None:
        return {"name": name, "measured": None, "target": target, "met": False, "detail": detail or "not measured"}
    met = measured <= target if at_most else measured >= target
    return {"name": name, "measured": round(measured, 3), "target": target, "at_most": at_most, "met": met,
            "detail": detail}


def _sat(workload: dict[str, Any], system: str) -> float | None:
    try:
        return float(workload["systems"][system]["closed"]["saturation"]["throughput_rps"])
    except KeyError:
        return None


def _median(values: list[float]) -> float | None:
    return round(statistics.median(values), 3) if values else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else a / b


def _resnet18_surge(w: dict[str, Any], deadline_s: float) -> dict[str, Any]:
    """Goodput within the deadline / capacity at 5x: the median of the surge's rounds, or the
    sweep's one point in a run without them."""
    capacity = w.get("capacity_rps")
    rounds = w.get("surge_rounds", {}).get("runs", {}).get("router", [])
    if rounds:
        ratios = [r["ratio"] for r in rounds]
        devices = "; ".join(f"busy {r['device'].get('busy_share')}, mean batch {r['device'].get('mean_batch')}"
                            for r in rounds)
        statuses = "; ".join(", ".join(f"{k}: {v}" for k, v in sorted(r["statuses"].items())) for r in rounds)
        return _target(f"resnet18 at 5x open loop: router goodput / capacity (median of {len(rounds)})",
                       _median(ratios), 0.8,
                       detail=f"each: {ratios}; goodput {[r['goodput_rps'] for r in rounds]} rps within {deadline_s} s, "
                              f"capacity {capacity} rps; {statuses}; device {devices}")
    five = next((p for p in w["systems"]["router"].get("open", []) if p["multiple"] == 5.0), None)
    goodput = None if five is None else five["goodput_rps"]
    return _target("resnet18 at 5x open loop: router goodput / capacity", _ratio(goodput, capacity), 0.8,
                   detail=f"goodput {goodput} rps within {deadline_s} s, capacity {capacity} rps")


def evaluate(results: dict[str, Any]) -> list[dict[str, Any]]:
    """The issue's targets, each as a ratio (or a difference) from this run."""
    targets: list[dict[str, Any]] = []
    runs = results["workloads"]
    if "resnet18" in runs:
        w = runs["resnet18"]
        limit = w["limit"]["with_decode_rps"]
        targets.append(_target("resnet18: router / limit (decode included)", _ratio(_sat(w, "router"), limit), 0.95,
                               detail=f"router {_sat(w, 'router')} rps, limit {limit} rps"))
        targets.append(_target("resnet18: router / LitServe", _ratio(_sat(w, "router"), _sat(w, "litserve")), 1.0,
                               detail=f"LitServe {_sat(w, 'litserve')} rps"))
        targets.append(_resnet18_surge(w, results["deadline_s"]))
    if "photo" in runs:
        w = runs["photo"]
        limit = w["limit"]["with_decode_rps"]
        targets.append(_target("photo: router / limit (decode included)", _ratio(_sat(w, "router"), limit), 0.95,
                               detail=f"router {_sat(w, 'router')} rps, limit {limit} rps, bus.jpg 810x1080"))
        targets.append(_target("photo: router / LitServe", _ratio(_sat(w, "router"), _sat(w, "litserve")), 1.05,
                               detail=f"LitServe {_sat(w, 'litserve')} rps"))
        capacity = w.get("capacity_rps")
        alone = w.get("refusal_cost", {}).get("server_cpu_ms_per_refusal")
        for start in ("cold", "warm"):
            points = [p for p in w.get("surge", []) if p["start"] == start]
            if not points:
                continue
            ratios = [_ratio(p["goodput_rps"], capacity) for p in points]
            statuses = "; ".join(", ".join(f"{k}: {v}" for k, v in sorted(p["statuses"].items())) for p in points)
            targets.append(_target(f"photo at 5x open loop, {start} start: goodput / capacity (median of {len(points)})",
                                   _median([r for r in ratios if r is not None]), 0.9,
                                   detail=f"each: {[None if r is None else round(r, 3) for r in ratios]}; goodput {[p['goodput_rps'] for p in points]} rps, capacity "
                                          f"{capacity} rps; {statuses}; 503 without Retry-After: "
                                          f"{sum(p['rejected_without_retry_after'] for p in points)}"))
            p99 = [p.get("rejected_ms", {}).get("p99") for p in points]
            targets.append(_target(f"photo at 5x open loop, {start} start: refusal p99 (ms), the worst of {len(points)}",
                                   max((x for x in p99 if x is not None), default=None), 10.0, at_most=True,
                                   detail=f"each: {p99}; server CPU per refusal {alone} ms measured alone, at most "
                                          f"{[p.get('cpu_ms_per_refusal_at_most') for p in points]} ms in these surges"))
        for plugin in ("resnet", "yolo"):
            cost = w.get("preprocess", {}).get(f"{plugin} bus.jpg")
            targets.append(_target(f"photo: {plugin} preprocessing of bus.jpg, before / after (one thread)",
                                   None if cost is None else cost["speedup_exact"], 2.0,
                                   detail="" if cost is None else f"{cost['ms']} ms"))
        four = w.get("four_models")
        if four is not None:
            targets.append(_target("photo: four ResNet18 models round-robin / one model (c16)", four["ratio"], 0.9,
                                   detail=f"{four['rps']} rps; per server CPU-second {four['per_cpu_s']} "
                                          f"(ratio {four['ratio_per_cpu_s']})"))
    if "accelerator" in runs:
        w = runs["accelerator"]
        limit = w["limit"].get("analytic_rps")
        targets.append(_target("accelerator: router / limit (max batch / batch time)",
                               _ratio(_sat(w, "router"), limit), 0.9,
                               detail=f"router {_sat(w, 'router')} rps, limit {limit} rps"))
        targets.append(_target("accelerator: router / LitServe", _ratio(_sat(w, "router"), _sat(w, "litserve")), 1.4,
                               detail=f"LitServe {_sat(w, 'litserve')} rps"))
    if "tiny" in runs:
        w = runs["tiny"]
        direct = w["limit"]["single_ms"]["p50"]
        try:
            router = float(w["systems"]["router"]["closed"]["c1"]["ok_ms"]["p50"])
        except (KeyError, TypeError):
            router = None
        added = None if router is None else router - direct
        targets.append(_target("tiny: router p50 - direct p50 at concurrency 1 (ms)", added, 2.0, at_most=True,
                               detail=f"router {router} ms over HTTP, direct call {direct} ms"))
    page = results.get("page_overhead", {})
    if "ratio" in page:
        targets.append(_target("tiny at c=32: throughput with /ui open in a browser / without (median of rounds)",
                               page["ratio"], 0.95,
                               detail=f"without {page['without_rps']} rps, with {page['with_page_rps']} rps; "
                                      f"router CPU per request with / without {page['cpu_per_request_ratio']}; "
                                      f"the page's Chromium used {page['browser_cpu_share']} of a core"))
    tracing = results.get("tracing_overhead", {})
    if tracing.get("cpu_off_over_before") is not None:
        cpu = tracing["median_cpu_ms_per_request"]
        targets.append(_target("no-op at c=32: router CPU per request, tracing off / before tracing (median of rounds)",
                               tracing["cpu_off_over_before"], 1.03, at_most=True,
                               detail=f"before {cpu['before']} ms, off {cpu['off']} ms, 1% sampled {cpu.get('1%')} ms, "
                                      f"all sampled {cpu.get('100%')} ms"))
    if results.get("mirror", {}).get("runs"):
        targets.append(_mirror(results["mirror"]))
    return targets + _scenario_targets(results.get("scenarios", {}))


def _mirror(mirror: dict[str, Any]) -> dict[str, Any]:
    """The stable version's goodput / capacity at 5x with a 100% mirror, over the same without one
    (benchmarks/mirror.py): the median of the rounds; each round must reach the target too."""
    runs = mirror["runs"]
    ratios = [r["ratio"] for r in runs]
    arms = "; ".join(f"{r['with']['ratio']} / {r['without']['ratio']}" for r in runs)
    copies = "; ".join(", ".join(f"{o}: {n}" for o, n in sorted(outcomes.items()))
                       for r in runs for outcomes in r["with"]["copies"].values())
    lowest = min((x for x in ratios if x is not None), default=None)
    name = (f"{mirror.get('workload', 'resnet18')} at 5x open loop: goodput / capacity with a 100% mirror / without"
            f" (median of {len(runs)})")
    target = _target(name, _median([x for x in ratios if x is not None]), mirror.get("target", 0.95),
                     detail=f"each: {ratios} (lowest {lowest}); with / without of capacity: {arms}; goodput with / "
                            f"without {[r['goodput_ratio'] for r in runs]}; mirror copies in each surge: {copies}")
    target["met"] = target["met"] and lowest is not None and lowest >= target["target"]
    return target


def _scenario_targets(scenarios: dict[str, Any]) -> list[dict[str, Any]]:
    """The cluster's targets (issue 13), residency against Ray Serve's multiplexing (issue 11), pipelines (issue 22)."""
    targets: list[dict[str, Any]] = []
    if "cluster" in scenarios:
        c = scenarios["cluster"]
        one, two = c["throughput"]["one_replica"], c["throughput"]["two_replicas"]
        targets.append(_target("cluster: two device replicas / one, accelerator at concurrency 128", c["throughput"]["ratio"],
                               1.6, detail=f"{two['throughput_rps']} / {one['throughput_rps']} rps"))
        p50 = c["latency"]["p50_ms"]
        targets.append(_target("cluster: added p50 over one process, no-op model at concurrency 1 (ms)",
                               c["latency"]["added_p50_ms"]["cluster_front"], 3.0, at_most=True,
                               detail=f"single {p50['single_process']} ms, our front {p50['cluster_front']} ms, "
                                      f"Ray proxy + serve.ingress {p50['ray_proxy_ingress']} ms"))
        rr = c["round_robin"]
        targets.append(_target("cluster: four on-demand models, two per replica: served without a load",
                               rr["served_without_load"], 0.95,
                               detail=f"{rr['statuses']} at {rr['throughput_rps']} rps, {rr['replicas_serving']} replicas serving"))
    if "pipeline" in scenarios:
        p = scenarios["pipeline"]
        for other, label in (("client_chain", "the client chain over HTTP (N+1 requests)"),
                             ("ray_serve", "Ray Serve composition (handles, @serve.batch)")):
            targets.append(_target(f"pipeline: detect-classify images/s, router / {label}, c=16",
                                   p["ratios"][f"router_over_{other}"], 1.5,
                                   detail=f"{p['images_per_s']} images/s; p99 {p['p99_ms']} ms; classifier mean "
                                          f"batch {p['router'].get('classifier_mean_batch')}"))
    if "split" in scenarios:  # issue 21: HTTP fronts on every core, one engine
        f = scenarios["split"]["figures"]
        targets.append(_target("split host: engine CPU per request, fast accelerator, workers 2 (us)", f["fast_engine_us"],
                               50.0, at_most=True, detail=f"engine alone, batches of 64: {f['engine_alone_us']} us; "
                                                          f"no-op model: {f['noop_engine_us']} us"))
        targets.append(_target("split host: front CPU per request / the bare Litestar handler's, no-op model",
                               f["front_over_bare"], 2.0, at_most=True,
                               detail=f"fronts {f['noop_front_us']} us, bare {f['bare_us']} us, one process "
                                      f"{f['noop_one_process_us']} us"))
        targets.append(_target("split host: workers 2 / workers 1, fast accelerator", f["w2_over_w1"], 1.5,
                               detail=f"{f['fast_w2_rps']} / {f['fast_w1_rps']} rps on {scenarios['split']['cores']} cores; "
                                      f"16-core projection {scenarios['split']['projection']['ratio']}x"))
    if "multiplex" in scenarios:
        m = scenarios["multiplex"]
        r = m["ratios"]
        rps = {f"{s}/{k}": v["throughput_rps"] for s in ("router", "ray_serve") for k, v in m[s].items()}
        targets.append(_target("residency: router holding two of four / all four resident",
                               r["router_two_of_four_over_all_4"], 0.8, detail=f"{rps}"))
        targets.append(_target("residency: router holding two of four / Ray Serve multiplexing max 2",
                               r["router_two_of_four_over_ray_max_2"], 1.5,
                               detail=f"Ray max 2 / all 4: {r['ray_max_2_over_all_4']}"))
    return targets


def _row(cells: list[str], widths: list[int]) -> str:
    return "  ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True))


def _rows(results: dict[str, Any]) -> list[list[str]]:
    rows = [["workload", "system", "load", "ok rps", "good rps", "p50 ms", "p90 ms", "p99 ms", "statuses", "RSS MB"]]
    for name, system, label, r in _scenario_runs(results.get("scenarios", {})):
        statuses = " ".join(f"{k}:{v}" for k, v in sorted(r["statuses"].items()))
        rows.append([name, system, label, str(r["throughput_rps"]), str(r["goodput_rps"]), str(r["ok_ms"]["p50"]),
                     str(r["ok_ms"]["p90"]), str(r["ok_ms"]["p99"]), statuses, ""])
    for name, w in results["workloads"].items():
        if name == "residency":
            for model, c in w["cold_start"].items():
                rows.append([name, "router", f"cold start {model}", "", "", f"first load {c['first_load_s']} s",
                             f"reload {c['reload_s']} s", "", "", ""])
            continue
        limit = w["limit"]
        rows.append([name, "direct (limit)", f"batch {limit['batch']}",
                     f"{limit['with_decode_rps']} / {limit['without_decode_rps']} no-decode", "",
                     str(limit["single_ms"]["p50"]), "", "", "", ""])
        for system, s in w["systems"].items():
            points = [(label, r) for label, r in s["closed"].items()]
            points += [(f"open {p['multiple']}x={p['offered_rps']}/s", p) for p in s.get("open", [])]
            if system == "router":
                points += [(f"surge {p['start']} #{p.get('round', 0)} 5x={p['offered_rps']}/s", p) for p in w.get("surge", [])]
            for label, r in points:
                rss = r.get("peak_rss_mb", s["peak_rss_mb"])
                statuses = " ".join(f"{k}:{v}" for k, v in sorted(r["statuses"].items()))
                rows.append([name, system, label, str(r["throughput_rps"]), str(r["goodput_rps"]),
                             str(r["ok_ms"]["p50"]), str(r["ok_ms"]["p90"]), str(r["ok_ms"]["p99"]), statuses, str(rss)])
    mirror = results.get("mirror", {})
    for run in mirror.get("runs", []):  # the surges with a 100% mirror and without
        for arm in run["order"]:
            r = run[arm]
            statuses = " ".join(f"{k}:{v}" for k, v in sorted(r["statuses"].items()))
            label = f"surge {arm} mirror #{run['round']} 5x={r['offered_rps']}/s"
            rows.append([mirror.get("workload", "resnet18"), "router", label, "", str(r["goodput_rps"]), str(r["ok_ms"]["p50"]), str(r["ok_ms"]["p90"]), str(r["ok_ms"]["p99"]),
                         statuses, ""])
    return rows


def _scenario_runs(scenarios: dict[str, Any]) -> list[tuple[str, str, str, dict[str, Any]]]:
    runs = []
    if "cluster" in scenarios:
        c = scenarios["cluster"]
        runs += [("cluster", "router on Ray", "accel c=128, 1 replica", c["throughput"]["one_replica"]),
                 ("cluster", "router on Ray", "accel c=128, 2 replicas", c["throughput"]["two_replicas"])]
        runs += [("cluster", name, "no-op c=1", run) for name, run in c["latency"]["runs"].items()]
        runs.append(("cluster", "router on Ray", "4 models, 2/replica, c=16", c["round_robin"]))
    if "multiplex" in scenarios:
        m = scenarios["multiplex"]
        runs += [("multiplex", system, f"4 x ResNet18, {label}, c=16", run)
                 for system in ("router", "ray_serve") for label, run in m[system].items()]
    if "protocols" in scenarios:  # tritonclient over gRPC and HTTP, side by side
        p = scenarios["protocols"]
        runs += [("protocols", f"tritonclient {run['protocol']}",
                  f"{run['model']} {key.partition('/')[2]}, c={run['concurrency']}", run) for key, run in p["runs"].items()]
    if "split" in scenarios:
        for label in ("fast", "noop"):
            part = scenarios["split"][label]
            runs += [("split", name, f"{label} c={part['concurrency']} (median of {c['rounds']})", c["median_run"])
                     for name, c in part["contenders"].items()]
    if "pipeline" in scenarios:
        p = scenarios["pipeline"]
        runs += [("pipeline", system, "detect-classify photos, c=16 (rps = images/s)", p[system])
                 for system in ("router", "client_chain", "ray_serve")]
    return runs


def render(results: dict[str, Any]) -> str:
    """The printed table: every measurement, then the targets with met or MISSED."""
    rows = _rows(results)
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = [_row(r, widths) for r in rows]
    lines.append("")
    for t in results.get("targets", []):
        sign = "<=" if t.get("at_most") else ">="
        verdict = "met" if t["met"] else "MISSED"
        lines.append(f"{verdict:6}  {t['name']}: {t['measured']} (target {sign} {t['target']}); {t['detail']}")
    return "\n".join(lines)


def plot(results: dict[str, Any], path: Path) -> None:
    """Throughput (answered, and within the deadline) and p99 against offered load, one line per system."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    w = results["workloads"]["resnet18"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for system, s in w["systems"].items():
        points = s.get("open", [])
        offered = [p["offered_rps"] for p in points]
        line = left.plot(offered, [p["throughput_rps"] for p in points], marker="o", label=f"{system}: 200s")[0]
        left.plot(offered, [p["goodput_rps"] for p in points], marker="x", linestyle="--", color=line.get_color(),
                  label=f"{system}: within {results['deadline_s']:g} s")
        right.plot(offered, [(p["ok_ms"]["p99"] or float("nan")) for p in points], marker="o", color=line.get_color(),
                   label=system)
    left.axhline(w["limit"]["with_decode_rps"], color="grey", linestyle=":", label="direct loop (limit)")
    left.set(xlabel="offered load, requests/s (open loop)", ylabel="answers/s", title="ResNet18: throughput")
    right.axhline(results["deadline_s"] * 1000, color="grey", linestyle=":", label="deadline")
    right.set(xlabel="offered load, requests/s (open loop)", ylabel="p99 of 200 answers, ms", yscale="log",
              title="ResNet18: p99 latency")
    left.legend(fontsize=7)
    right.legend(fontsize=7)
    fig.suptitle(f"{results['machine']['cpu']}, {results['machine']['cores']} cores", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
