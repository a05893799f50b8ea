"""Keeps the benchmark harness from rotting: its pieces import, the single-queue contender serves,
the load generator drives it, and the report renders. A few seconds; no timing assertions."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest

pytest.importorskip("fastapi", reason="bench-only dependency: `make bench` installs it")

from benchmarks.direct import measure
from benchmarks.report import evaluate, render
from benchmarks.run import closed
from benchmarks.systems import request_target, serve
from benchmarks.workloads import WORKLOADS

pytestmark = [pytest.mark.e2e]


def test_single_queue_contender_answers_the_load_generator(tmp_path: Path) -> None:
    workload = WORKLOADS["tiny"]
    with serve("single_queue", workload, tmp_path, tmp_path, timeout_s=60) as server:
        report = closed(server, request_target("single_queue", workload, tmp_path), 2, 1.0)
    assert report["requests"] > 0
    assert set(report["statuses"]) == {"200"}, report
    assert report["ok_ms"]["p50"] is not None


def test_direct_loop_and_report_render(tmp_path: Path) -> None:
    limit = measure(WORKLOADS["tiny"], tmp_path, 0.2)
    assert limit["with_decode_rps"] > 0 and limit["single_ms"]["p50"] is not None
    run = {"requests": 1, "statuses": {"200": 1}, "throughput_rps": 1.0, "goodput_rps": 1.0,
           "ok_ms": {"p50": 1.0, "p90": 1.0, "p99": 1.0}}
    results = {"deadline_s": 1.0, "workloads": {"tiny": {"limit": limit, "systems": {
        "router": {"closed": {"c1": run, "saturation": run}, "peak_rss_mb": 1}}}}}
    results["targets"] = evaluate(results)
    table = render(results)
    assert "tiny" in table and "router" in table
    assert [t["name"] for t in results["targets"]] == ["tiny: router p50 - direct p50 at concurrency 1 (ms)"]


def test_tracing_bench_measures_every_server_and_the_receiver_gets_every_sampled_request(tmp_path: Path) -> None:
    from benchmarks.tracing import tracing_overhead

    result = tracing_overhead(tmp_path, seconds=0.5, rounds=1, warm_s=0.3)
    assert set(result["cpu_ms_per_request"]) == {"before", "off", "1%", "100%"}
    assert all(result["answered"][label] > 0 for label in result["answered"])
    assert result["requests_traced"]["100%"] == result["answered"]["100%"]  # a server span for each request
    assert result["requests_traced"].get("1%", 0) < result["answered"]["1%"]
    assert "off" not in result["requests_traced"] and "before" not in result["requests_traced"]
    results = {"deadline_s": 1.0, "workloads": {}, "tracing_overhead": result}
    assert [t["name"] for t in evaluate(results)] == [
        "no-op at c=32: router CPU per request, tracing off / before tracing (median of rounds)"]


def test_the_protocol_comparison_renders_in_the_table() -> None:
    run = {"model": "resnet18", "protocol": "grpc", "form": "jpeg", "concurrency": 4, "requests": 1, "statuses": {"ok": 1},
           "throughput_rps": 1.0, "goodput_rps": 1.0, "ok_ms": {"p50": 1.0, "p90": 1.0, "p99": 1.0}}
    results = {"deadline_s": 1.0, "workloads": {}, "scenarios": {"protocols": {"runs": {
        "grpc/jpeg#0": run, "http/jpeg#0": {**run, "protocol": "http"}},
        "ratios": {"jpeg": {"throughput_grpc_over_http": 1.0, "p99_grpc_over_http": 1.0}}}}}
    table = render(results)
    assert "tritonclient grpc" in table and "tritonclient http" in table and "resnet18 jpeg#0, c=4" in table


def test_the_pipeline_scenario_renders_and_its_client_chain_cuts_what_the_router_cuts() -> None:
    import simplejpeg

    from benchmarks.pipeline_chain import cut_and_encode
    from router.sdk.crop import CropOptions
    from router.sdk.images import example_jpeg

    detections = [{"box": [0, 0, 40, 30], "score": 0.9}, {"box": [50, 10, 90, 70], "score": 0.5}]
    crops = cut_and_encode(example_jpeg(120, 80).body, detections, CropOptions(max_items=1))
    assert [simplejpeg.decode_jpeg(c).shape for c in crops] == [(30, 40, 3)]  # the top-scoring one only
    run = {"requests": 2, "statuses": {"200": 2}, "throughput_rps": 1.0, "goodput_rps": 1.0,
           "ok_ms": {"p50": 1.0, "p90": 1.0, "p99": 1.0}}
    scenario = {"router": {**run, "classifier_mean_batch": 6.0}, "client_chain": {**run, "throughput_rps": 0.5},
                "ray_serve": run, "images_per_s": {"router": 1.0, "client_chain": 0.5, "ray_serve": 1.0},
                "p99_ms": {"router": 1.0, "client_chain": 1.0, "ray_serve": 1.0},
                "ratios": {"router_over_client_chain": 2.0, "router_over_ray_serve": 1.0}}
    results = {"deadline_s": 1.0, "workloads": {}, "scenarios": {"pipeline": scenario}}
    results["targets"] = evaluate(results)
    assert [t["met"] for t in results["targets"]] == [True, False]
    assert "client_chain" in render(results)


def test_the_split_host_scenario_measures_roles_projects_and_renders(tmp_path: Path) -> None:
    """One short run of a split router (its CPU per answer by role, as the scenario reads it), the
    engine alone, the projection, and the scenario's targets and rows in the report."""
    from benchmarks.engine_alone import engine_alone
    from benchmarks.split_host import contender_run, project, summarise
    from benchmarks.workloads import HOST_WORKLOADS

    run = contender_run("router", "2", HOST_WORKLOADS["noop"], tmp_path, tmp_path, 8, 1.0, 0.5)
    assert run["statuses"] == {"200": run["statuses"]["200"]} and {"engine", "front", "parent"} <= set(run["cpu_us_per_answer"])
    left = set(Path(tempfile.gettempdir()).glob("engine-alone-*"))
    alone = engine_alone(1, 8, 0.5, 8)
    assert alone["answered"] > 0 and alone["failed"] == 0 and alone["engine_cpu_us_per_request"] > 0
    assert set(Path(tempfile.gettempdir()).glob("engine-alone-*")) == left  # its scratch directory is gone
    projection = project(front_us=600.0, engine_us=40.0, one_process_us=700.0)
    assert projection["split_rps"] == 12308 and projection["split_bound_by"] == "the accelerator"  # 64 / 5.2 ms
    assert projection["one_process_rps"] == 1429 and projection["ratio"] == 8.62
    summary = summarise([run])
    figures = {"fast_engine_us": 40.0, "engine_alone_us": 30.0, "noop_engine_us": 45.0, "front_over_bare": 2.5,
               "noop_front_us": 600.0, "bare_us": 240.0, "noop_one_process_us": 700.0, "w2_over_w1": 1.6,
               "fast_w2_rps": 1600.0, "fast_w1_rps": 1000.0}
    scenario = {"cores": 2, "figures": figures, "projection": projection,
                "fast": {"concurrency": 256, "contenders": {"router 2": summary}},
                "noop": {"concurrency": 64, "contenders": {"router 2": summary}}}
    results = {"deadline_s": 1.0, "workloads": {}, "scenarios": {"split": scenario}}
    results["targets"] = evaluate(results)
    assert [t["met"] for t in results["targets"]] == [True, False, True]
    assert "fast c=256 (median of 1)" in render(results)


def test_the_mirror_rounds_read_the_copies_and_render(tmp_path: Path) -> None:
    """Both arms of one round at a tiny scale, on the test kit's scripted model (a batch of n costs
    40 + 2n ms): the result's shape, the mirror's copies read from /metrics, the target and the page."""
    from benchmarks.mirror import mirror_rounds
    from benchmarks.performance_doc import render as render_page
    from benchmarks.run import Plan
    from benchmarks.workloads import Workload

    workload = Workload("shadowed", "scripted", {"fixed_ms": 40, "per_item_ms": 2}, max_batch=4, max_delay_ms=5,
                        content_type="application/json", body=b'{"id": "bench"}')
    plan = Plan(limit_s=0.5, warm_s=0.3, closed_s=1.0, open_s=1.0)
    result = mirror_rounds(tmp_path, tmp_path, plan, rounds=1, workload=workload, second="{}")
    (run,) = result["runs"]
    assert run["order"] == ["without", "with"] and run["ratio"] is not None and run["goodput_ratio"] is not None
    for arm in ("without", "with"):
        assert run[arm]["goodput_rps"] > 0 and run[arm]["capacity_after_rps"] > 0
        assert run[arm]["answers_by_version"]["shadowed@1"]["ok"] == run[arm]["statuses"]["200"]
        assert "shadowed@2" not in run[arm]["answers_by_version"]  # all of the traffic goes to version 1
    assert run["without"]["copies"] == {}
    copies = run["with"]["copies"]["shadowed@2"]
    assert copies["shed"] + copies["admitted"] > 0 and set(copies) <= {"admitted", "served", "shed", "failed", "expired"}
    assert set(result["summary"]) >= {"ratio", "goodput_ratio", "with_ratio", "without_ratio", "copies_during_surges",
                                      "met"}
    results = {"deadline_s": 1.0, "workloads": {}, "mirror": result}
    results["targets"] = evaluate(results)
    assert [t["name"] for t in results["targets"]] == [
        "shadowed at 5x open loop: goodput / capacity with a 100% mirror / without (median of 1)"]
    assert "surge with mirror #1" in render(results)
    assert "## A mirror under a surge" in render_page(results)
