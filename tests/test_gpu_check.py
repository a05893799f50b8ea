"""The GPU check kit's decisions, driven with plain values: what the wheelhouse carries, whether it
fits, the results table, the parts' outcomes and time limits, the rehearsal's verdict; and one part
run for real past its time limit, its whole process tree stopped."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import psutil
import pytest

from gpu_check import environment, loads, rehearsal, results, run, surge, throughput, wheelhouse
from gpu_check.results import Row

REPO = Path(__file__).resolve().parents[1]
MiB = 2**20
ENV = wheelhouse.marker_environment("3.12")


def lookup_of(dists: dict[str, tuple[str, list[str]]]) -> wheelhouse.Lookup:
    return lambda name: dists.get(name)


DISTS = {
    "app": ("1.0", ["web[standard]>=2", "numpy>=2", "opencv-python>=4.6", "polars", "old; python_version < '3.12'",
                    "ray; extra == 'cluster'"]),
    "web": ("2.5", ["anyio", "uvloop; extra == 'standard'", "colour; sys_platform == 'win32'"]),
    "anyio": ("4.0", []),
    "uvloop": ("0.21", []),
    "numpy": ("2.4.6", []),
    "opencv-python": ("4.10", ["numpy"]),
    "polars": ("1.0", []),
}


# --- the wheelhouse ---------------------------------------------------------------------------------


def test_walk_follows_extras_and_markers_of_the_target_python() -> None:
    tree, missing = wheelhouse.walk(["app"], lookup_of(DISTS), ENV)
    assert set(tree) == {"app", "web", "anyio", "uvloop", "numpy", "opencv-python", "polars"}
    assert tree["web"].extras == {"standard"} and tree["numpy"].required_by == {"app", "opencv-python"}
    assert missing == []  # `old` is for Python < 3.12, `ray` an extra nobody asked for, `colour` Windows'
    tree_311, missing_311 = wheelhouse.walk(["app"], lookup_of(DISTS), wheelhouse.marker_environment("3.11"))
    assert missing_311 == ["old"] and "old" not in tree_311


def test_plan_leaves_the_machine_its_packages_and_says_why_others_stay_behind() -> None:
    tree, missing = wheelhouse.walk(["app"], lookup_of(DISTS), ENV)
    device = {"anyio": None, "numpy": "2.5.2", "uvloop": None, "opencv-python-headless": None}
    chosen = wheelhouse.plan(tree, device, missing)
    assert [p.name for p in chosen.carried] == ["app", "web"]
    assert [p.name for p in chosen.device_side] == ["anyio", "numpy", "uvloop"]
    assert set(chosen.left_out) == {"opencv-python", "polars"} and "cv2" in chosen.left_out["opencv-python"]
    assert chosen.warnings == [] and chosen.missing == []


def test_plan_carries_what_the_router_needs_newer_than_the_machine_may_have(monkeypatch: pytest.MonkeyPatch) -> None:
    tree, missing = wheelhouse.walk(["app"], lookup_of(DISTS), ENV)
    device = {"anyio": None, "numpy": "2.5.2", "uvloop": None, "opencv-python-headless": None}
    monkeypatch.setattr(wheelhouse, "CARRIED_OVER_THE_MACHINES", {"numpy": "a release at least this new"})
    chosen = wheelhouse.plan(tree, device, missing)
    assert [p.name for p in chosen.carried] == ["app", "numpy", "web"]
    assert [p.name for p in chosen.device_side] == ["anyio", "uvloop"]


def test_plan_warns_where_a_known_version_on_the_machine_does_not_meet_a_requirement() -> None:
    tree, _ = wheelhouse.walk(["app"], lookup_of(DISTS), ENV)
    chosen = wheelhouse.plan(tree, {"numpy": "1.26.4", "anyio": None, "uvloop": None})
    assert chosen.warnings == ["app 1.0 requires numpy>=2; the machine has numpy 1.26.4"]


def test_plan_names_what_is_needed_and_installed_nowhere() -> None:
    tree, missing = wheelhouse.walk(["app", "ghost>=1"], lookup_of(DISTS), ENV)
    assert wheelhouse.plan(tree, {}, missing).missing == ["ghost"]


def test_size_verdict_fails_above_the_limit_naming_the_largest_wheels() -> None:
    sizes = {"small.whl": 1 * MiB, "ray.whl": 76 * MiB, "mid.whl": 5 * MiB}
    fits, line = wheelhouse.size_verdict(sizes, 60 * MiB, largest=2)
    assert not fits
    assert line == "3 wheels, 82.0 MiB (limit 60 MiB): too large; the largest: ray.whl 76.0 MiB, mid.whl 5.0 MiB"
    assert wheelhouse.size_verdict({"small.whl": MiB}, 60 * MiB) == (True, "1 wheels, 1.0 MiB (limit 60 MiB)")


def test_device_packages_reads_names_and_known_versions() -> None:
    text = "# comment\nnumpy==2.5.2\nHuggingFace_Hub\n\nopencv-python-headless  # cv2\n"
    assert wheelhouse.device_packages(text) == {"numpy": "2.5.2", "huggingface-hub": None,
                                                "opencv-python-headless": None}
    listed = wheelhouse.device_packages((REPO / "gpu_check" / "device_packages.txt").read_text())
    assert listed["torch"] == "2.11.0" and "litestar" not in listed and "opencv-python-headless" in listed


# --- what the environment part checks ----------------------------------------------------------------


def test_requirements_met_by_a_provider_and_left_out_packages_are_no_problem() -> None:
    installed = {k: v for k, v in DISTS.items() if k not in ("opencv-python", "polars")}
    installed["opencv-python-headless"] = ("4.10", ["numpy"])
    tree, missing = wheelhouse.walk(["app"], environment.with_providers(lookup_of(installed)), ENV)
    assert missing == ["polars"] and "opencv-python" in tree
    assert environment.unmet(tree, missing) == []


def test_unmet_names_who_requires_what() -> None:
    installed = {**DISTS, "numpy": ("1.26.4", [])}
    del installed["anyio"]
    tree, missing = wheelhouse.walk(["app"], lookup_of(installed), ENV)
    assert environment.unmet(tree, missing) == [
        ("web", "web requires anyio, which is not installed"),
        ("app", "app 1.0 requires numpy>=2; installed: 1.26.4"),
    ]


def test_import_modules_tells_optional_packages_from_import_errors(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "uses_optional.py").write_text("import absent_optional_package\n")
    (tmp_path / "uses_missing.py").write_text("import absent_needed_package\n")
    (tmp_path / "broken.py").write_text("raise RuntimeError('no device')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(environment, "OPTIONAL", {"absent_optional_package": "not carried: its part skips"})
    imported, optional, failed = environment.import_modules(["json", "uses_optional", "uses_missing", "broken"])
    assert imported == ["json"]
    assert optional == {"uses_optional": "not carried: its part skips"}
    assert failed == {"uses_missing": "ModuleNotFoundError: No module named 'absent_needed_package'",
                      "broken": "RuntimeError: no device"}


# --- the results table --------------------------------------------------------------------------------


JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest">
<testcase classname="tests.test_gpu" name="test_nvml" time="0.30"><properties>
<property name="figure" value="NVML used 812 MiB" /></properties></testcase>
<testcase classname="tests.test_gpu" name="test_split" time="1.00"><failure message="assert 3 == 4">x</failure></testcase>
<testcase classname="tests.plugins.test_onnx" name="test_cuda" time="0"><skipped message="no CUDA GPU" /></testcase>
<testcase classname="tests.test_x" name="test_boom" time="0"><error message="fixture broke" /></testcase>
<testcase classname="tests.test_y" name="test_plain" time="2.5" /></testsuite></testsuites>"""


def test_junit_rows_carry_figures_reasons_and_failures() -> None:
    assert results.junit_rows(JUNIT, "gpu tests") == [
        Row("gpu tests", "test_gpu::test_nvml", "pass", "NVML used 812 MiB"),
        Row("gpu tests", "test_gpu::test_split", "FAIL", "assert 3 == 4"),
        Row("gpu tests", "test_onnx::test_cuda", "skipped", "no CUDA GPU"),
        Row("gpu tests", "test_x::test_boom", "FAIL", "fixture broke"),
        Row("gpu tests", "test_y::test_plain", "pass", "2.5 s"),
    ]
    assert results.junit_rows("<not xml", "p")[0].result == "FAIL"
    assert results.junit_rows("<testsuites/>", "p") == [Row("p", "tests", "FAIL", "the report holds no test case")]


def test_a_part_table_reads_back_and_unknown_results_count_as_failures() -> None:
    text = results.part_table([("a", "pass", "1 | 2"), ("b", "skipped", "no CUDA"), ("c", "maybe", "?")])
    assert results.parse_table(text, "p") == [Row("p", "a", "pass", "1 / 2"), Row("p", "b", "skipped", "no CUDA"),
                                              Row("p", "c", "FAIL", "?")]
    rows = results.parse_table(text, "p")
    assert results.summary(rows) == "3 checks: 1 pass, 1 FAIL, 1 skipped"
    rendered = results.render(rows)
    assert rendered.splitlines()[0] == "| part | check | result | detail |" and "| p | a | pass | 1 / 2 |" in rendered
    assert rehearsal.results_rows(rendered) == rows


# --- the parts' outcomes and time limits -----------------------------------------------------------------


PART = run.Part("surge", ("-m", "x"), 75, "surge/surge.md")


def test_outcome_rows_add_a_failure_for_a_time_limit_a_silent_part_and_an_unexplained_exit() -> None:
    table = results.part_table([("capacity", "info", "9 rps")])
    timed_out = run.outcome_rows(PART, None, 75, table, "logs/surge.log")
    assert [r.result for r in timed_out] == ["info", "FAIL"] and "stopped after 75 s" in timed_out[1].detail
    assert run.outcome_rows(PART, 1, 75, None, "logs/surge.log") == [
        Row("surge", "results", "FAIL", "wrote none (exit status 1); see logs/surge.log")]
    assert run.outcome_rows(PART, 2, 75, table, "l")[-1] == Row("surge", "exit status", "FAIL", "2; see l")
    failing = results.part_table([("capacity", "FAIL", "refused")])
    assert len(run.outcome_rows(PART, 1, 75, failing, "l")) == 1  # its own row already says so
    assert run.outcome_rows(PART, 0, 75, table, "l") == [Row("surge", "capacity", "info", "9 rps")]


def test_each_part_gets_its_limit_within_what_is_left_of_the_budget() -> None:
    assert run.time_for(PART, 400) == 75
    assert run.time_for(PART, 30) == 30
    assert run.time_for(PART, run.MIN_PART_S - 1) is None


def test_without_a_wheelhouse_the_environment_part_is_not_told_of_one(tmp_path: Path) -> None:
    environment_part = run.PARTS[0]
    assert run.part_command(environment_part, "py", tmp_path, None) == ["py", "-m", "gpu_check.environment",
                                                                         str(tmp_path)]
    assert run.part_command(environment_part, "py", tmp_path, tmp_path / "w")[-2:] == ["--wheelhouse",
                                                                                      str(tmp_path / "w")]


def test_every_file_with_gpu_tests_is_run_by_the_check() -> None:
    marked = {str(path.relative_to(REPO)) for path in (REPO / "tests").rglob("test_*.py")
              if re.search(r"mark\.gpu\b", path.read_text(encoding="utf-8"))}
    assert marked == set(run.GPU_TEST_FILES)


def test_a_part_past_its_limit_is_stopped_with_the_processes_it_started(tmp_path: Path) -> None:
    """The part starts a server-like child in a session of its own (as benchmarks.systems does), then
    hangs: both are gone when run_part returns, and the rows say why."""
    pid_file = tmp_path / "child.pid"
    code = ("import subprocess, sys, time; "
            "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'], start_new_session=True); "
            f"open({str(pid_file)!r}, 'w').write(str(child.pid)); time.sleep(120)")
    part = run.Part("hang", ("-c", code), 3, "hang.md")
    rows = run.run_part(part, sys.executable, tmp_path, None, limit_s=3)
    assert rows == [Row("hang", "time limit", "FAIL", "stopped after 3 s; see logs/hang.log")]
    try:
        psutil.Process(int(pid_file.read_text())).wait(10)  # killed: gone once reaped
    except psutil.NoSuchProcess:
        pass


# --- the GPU parts' rows from plain figures ---------------------------------------------------------------


def report(statuses: dict[str, int], rps: float = 100.0, errors: dict[str, int] | None = None) -> dict[str, object]:
    return {"requests": sum(statuses.values()), "statuses": statuses, "errors": errors or {}, "throughput_rps": rps,
            "ok_ms": {"p50": 10.0, "p99": 40.0}, "rejected_without_retry_after": 0}


def test_merge_sums_counts_and_keeps_the_worst_latency() -> None:
    a = {**report({"200": 90, "503": 10}, rps=50.5), "ok_ms": {"p50": 10.0, "p99": 30.0}}
    b = {**report({"200": 80}, rps=40.0, errors={"timeout": 2}), "ok_ms": {"p50": 12.0, "p99": None}}
    merged = loads.merge([a, b])
    assert merged["requests"] == 180 and merged["throughput_rps"] == 90.5
    assert merged["statuses"] == {"200": 170, "503": 10} and merged["errors"] == {"timeout": 2}
    assert merged["ok_ms"] == {"p50": 12.0, "p99": 30.0}


def test_metric_reads_one_device_gauge() -> None:
    text = 'model_router_ledger_peak_bytes{device="cpu"} 5.0\nmodel_router_ledger_peak_bytes{device="cuda:0"} 7e9\n'
    assert loads.metric(text, "model_router_ledger_peak_bytes", "cuda:0") == 7e9
    assert loads.metric(text, "model_router_queue_depth", "cuda:0") == 0.0


def surge_figures(**changes: object) -> dict[str, object]:
    figures = {"paths": {"resnet": "/r", "yolo": "/y"}, "clients": "4 clients", "budget": 10 * 2**30,
               "baseline": 6 * 2**30, "surge_s": 10.0, "paused": 3, "samples": 90, "oom_lines": 0,
               "peaks": (9 * 2**30, 3 * 2**30), "cuda": True, "ledger_peak": 2 * 2**30}
    return {**figures, **changes}


def surge_of(statuses: dict[str, int], **changes: object) -> list[tuple[str, str, str]]:
    capacity = {"targets": {"/r": report({"200": 10}, rps=300), "/y": report({"200": 10}, rps=200)}}
    return surge.surge_rows(capacity, report(statuses), {"/r": 1500, "/y": 1000}, surge_figures(**changes))


def test_a_surge_answered_or_shed_within_the_budget_passes() -> None:
    rows = surge_of({"200": 4000, "503": 20000, "504": 900})
    assert [r for _, r, _ in rows] == ["info", "pass", "pass", "pass", "info"]
    assert rows[0][2].startswith("resnet 300 rps, yolo 200 rps (4 clients; budget 10.00 GiB, 4.00 GiB above")
    assert "offered 2500 rps, sent 2490 rps for 10 s: 200 4000, 503 20000" in rows[1][2]
    assert rows[4][2] == "ledger peak 2.00 GiB, the router's NVML peak 3.00 GiB (ledger/NVML 0.67)"


def test_a_surge_fails_on_a_lost_request_an_out_of_memory_or_a_reading_over_the_budget() -> None:
    assert surge_of({"200": 10, "500": 1})[1][1] == "FAIL"
    assert surge_of({"200": 10, "0": 1})[1][1] == "FAIL"
    assert surge_of({"200": 10}, oom_lines=2)[2] == ("no CUDA out-of-memory", "FAIL",
                                                     "2 out-of-memory lines in the router's log")
    assert surge_of({"200": 10}, peaks=(11 * 2**30, 3 * 2**30))[3][1] == "FAIL"
    assert surge_of({"200": 10}, peaks=(11 * 2**30, 3 * 2**30), cuda=False)[3][1] == "info"  # RSS, not the card
    assert surge_of({"200": 10}, peaks=(0, 0))[3] == ("NVML within the budget", "FAIL", "NVML gave no reading")


def test_a_container_hiding_the_routers_process_from_nvml_leaves_its_peak_unknown() -> None:
    row = surge_of({"200": 10}, peaks=(9 * 2**30, 0))[4]
    hidden = "NVML listed no memory for the router's process (a container may hide it)"
    assert row == ("ledger vs NVML under load", "info", f"ledger peak 2.00 GiB, {hidden}")


def test_throughput_rows_set_resnet_beside_tritons_figure() -> None:
    label, result, detail = throughput.throughput_rows("resnet50 eager", report({"200": 900}, rps=3063.5), True, "4x48")
    assert (label, result) == ("resnet50 eager", "info")
    assert detail.endswith("over 900 answers (4x48); 0.50x Triton's 6,127 img/s (A100, published)")
    assert "Triton" not in throughput.throughput_rows("yolo", report({"200": 9}), False, "c")[2]
    assert throughput.throughput_rows("yolo", report({"200": 9, "503": 1}), False, "c")[1] == "FAIL"


def test_the_variants_measured_on_cuda_and_on_the_cpu() -> None:
    on_cuda = [v.name for v in throughput.variants("cuda:0", "resnet50", onnx=False)]
    assert on_cuda == ["resnet-eager", "yolo-eager", "resnet-nvjpeg", "resnet-nvjpeg-fp16", "yolo-nvjpeg"]
    assert [v.name for v in throughput.variants("cpu", "resnet18", onnx=True)] == [
        "resnet-eager", "yolo-eager", "resnet-onnx", "yolo-onnx"]
    fleet = throughput.fleet_yaml(Path("/s"), "cuda:0", throughput.variants("cuda:0", "resnet50", onnx=False))
    assert '"gpu_decode": true, "half": true' in fleet and "probe: nvml" in fleet


# --- the rehearsal's verdict ----------------------------------------------------------------------------


GOOD = [Row("set-up", "install the wheelhouse", "pass", "31 wheels"), Row("environment", "GPU", "info", "no CUDA"),
        Row("environment", "imports", "pass", "121 modules"), Row("gpu tests", "t", "skipped", "needs a CUDA GPU"),
        Row("surge", "capacity", "skipped", "no CUDA: ...")]


def test_the_rehearsal_passes_only_with_every_gpu_row_skipped_for_want_of_cuda() -> None:
    assert rehearsal.verdict(GOOD) == []
    assert rehearsal.verdict([*GOOD, Row("environment", "imports", "FAIL", "x: ImportError")]) == [
        "environment / imports: FAIL: x: ImportError"]
    ran = rehearsal.verdict([*GOOD, Row("surge", "capacity", "info", "3 rps")])
    assert ran == ["surge / capacity: info where a skip for want of CUDA was due: 3 rps"]
    other = rehearsal.verdict([*GOOD, Row("cluster", "two replicas", "skipped", "Ray is not installed")])
    assert len(other) == 1 and "Ray is not installed" in other[0]
    assert rehearsal.verdict(GOOD[:1]) == ["no environment rows", "no gpu tests rows"]


def test_the_emulated_machine_gets_its_own_distributions_and_providers_fetched() -> None:
    here = ["torch", "Litestar", "opencv-python", "pytest", "numpy"]
    device = ["torch", "numpy", "pytest", "opencv-python-headless", "jax"]
    assert rehearsal.device_distributions(here, device) == (["numpy", "pytest", "torch"], ["opencv-python-headless"])
