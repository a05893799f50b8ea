"""docs/performance.md is generated from a bench run's JSON: the table from a small run, the
sections a partial run lacks left out, and the committed page equal to the committed results."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from benchmarks.performance_doc import DOC, RESULTS, render, write


def _run(ok: int, refused: int, rps: float, good: float, p50: float, concurrency: int = 16) -> dict[str, Any]:
    return {"concurrency": concurrency, "statuses": {"200": ok, **({"503": refused} if refused else {})},
            "throughput_rps": rps, "goodput_rps": good, "ok_ms": {"p50": p50, "p90": p50 + 10, "p99": p50 + 20},
            "server_cpu_ms_per_request": 39.75}


def small_results(started: str = "2026-12-01T08:00:00Z") -> dict[str, Any]:
    return {
        "machine": {"cpu": "Test CPU", "cores": 2, "memory_gib": 23.5, "python": "3.11.7", "torch": "2.14.1",
                    "torch_threads": 2, "os": "Linux", "load_average_start": [0.2, 0.1, 0.1]},
        "command": "make bench", "started": started, "wall_s": 300.5, "deadline_s": 1.0,
        "load_average_end": [1.5, 1.0, 0.5],
        "workloads": {"resnet18": {
            "limit": {"batch": 8, "with_decode_rps": 42.6, "without_decode_rps": 42.4, "single_ms": {"p50": 28.0}},
            "systems": {
                "router": {"closed": {"saturation": _run(368, 0, 44.53, 44.53, 357.1)}, "peak_rss_mb": 854,
                           "open": [{"multiple": 5.0, "offered_rps": 222.65, "peak_rss_mb": 876,
                                     **_run(314, 1455, 39.25, 38.75, 859.7)}]},
                "litserve": {"closed": {"saturation": _run(326, 0, 39.72, 39.72, 403.4)}, "peak_rss_mb": 1019},
            }}},
        "targets": [
            {"name": "resnet18: router / limit", "measured": 1.045, "target": 0.95, "at_most": False, "met": True,
             "detail": "router 44.53 rps"},
            {"name": "tiny: added p50 (ms)", "measured": 2.5, "target": 2.0, "at_most": True, "met": False,
             "detail": "a | in the detail"},
        ],
    }


def test_the_table_holds_each_run_of_the_json() -> None:
    page = render(small_results())
    assert "| ResNet18 (street.jpg) | model-router | closed, c=16 | 44.53 | 44.53 | 357.1 / 367.1 / 377.1 | 200:368 " \
           "| 39.75 | 854 |" in page
    assert "| ResNet18 (street.jpg) | model-router | open, 5.0× = 222.65/s | 39.25 | 38.75 | 859.7 / 869.7 / 879.7 " \
           "| 200:314 503:1455 | 39.75 | 876 |" in page
    assert "| ResNet18 (street.jpg) | direct loop (the limit) | batch 8 | 42.6 with decoding, 42.4 without |" in page


def test_the_machine_and_date_are_stated() -> None:
    page = render(small_results())
    assert "started 2026-12-01 08:00:00 UTC, 300.5 s" in page
    assert "**Machine:** Test CPU, 2 cores, 23.5 GiB RAM" in page
    assert "0.2 at the start, 1.5 at the end" in page


def test_targets_say_met_or_missed_with_their_direction() -> None:
    page = render(small_results())
    assert "| resnet18: router / limit | 1.045 | ≥ 0.95 | met | router 44.53 rps |" in page
    assert "| tiny: added p50 (ms) | 2.5 | ≤ 2.0 | **missed** | a \\| in the detail |" in page
    assert "1 of 2 met" in page


def test_sections_absent_from_a_partial_run_are_left_out() -> None:
    page = render(small_results())
    for heading in ("## ResNet18 surges", "## Photo surges", "## Cold starts", "## Cluster", "## The live page", "## Four models"):
        assert heading not in page
    assert "## Throughput and latency" in page


def test_the_resnet18_surge_rounds_are_tabled_with_what_the_device_did() -> None:
    results = small_results()
    device = {"batches": 30, "mean_batch": 8.0, "median_batch_ms": 338.2, "busy_share": 0.998}
    results["workloads"]["resnet18"]["surge_rounds"] = {"runs": {"router": [
        {"round": 1, "offered_rps": 222.65, "goodput_rps": 38.75, "ratio": 0.87, "statuses": {"200": 314, "503": 1455},
         "device": device}]}}
    page = render(results)
    assert "## ResNet18 surges" in page
    assert "| 1 | 222.65 | 38.75 | 0.87 | 200:314 503:1455 | 0.998 | 8.0 | 338.2 |" in page


def test_litserve_cpu_is_marked_unmeasured_in_runs_that_did_not_count_its_workers() -> None:
    old = render(small_results(started="2026-11-30T13:21:37Z"))
    assert "| LitServe | closed, c=16 | 39.72 | 39.72 | 403.4 / 413.4 / 423.4 | 200:326 | –* | 1019 |" in old
    assert "–*: not measured" in old
    new = render(small_results())
    assert "| 200:326 | 39.75 | 1019 |" in new and "–*" not in new


def test_write_puts_the_page_where_asked(tmp_path: Path) -> None:
    out = write(small_results(), tmp_path / "performance.md")
    assert out.read_text(encoding="utf-8") == render(small_results())


def test_the_committed_page_is_generated_from_the_committed_results() -> None:
    """`make bench` rewrites both; a hand edit of either shows here."""
    expected = render(json.loads(RESULTS.read_text(encoding="utf-8")))
    assert DOC.read_text(encoding="utf-8") == expected, "run: python -m benchmarks.performance_doc"


def test_the_split_host_section_states_its_figures_and_targets() -> None:
    """From the committed split-host run (benchmarks/results/split_host.json) as a run's scenario."""
    split = json.loads((RESULTS.parent / "split_host.json").read_text(encoding="utf-8"))
    page = render({**small_results(), "scenarios": {"split": split}})
    assert "## One host split into fronts and an engine" in page
    fast = split["fast"]["contenders"]["router 2"]
    assert (f"| fast accelerator, c=256 | router, workers 2 | {fast['throughput_rps']['median']:g} "
            f"({fast['throughput_rps']['min']:g}–{fast['throughput_rps']['max']:g})") in page
    assert f"workers 2 ÷ workers 1 {split['figures']['w2_over_w1']:g}" in page
    for what, met in split["targets"].items():
        assert f"- {'met' if met else 'missed'}: {what}" in page
    assert "## One host split" not in render(small_results())


def test_the_split_host_section_states_each_processs_memory() -> None:
    """RSS by process role: per contender (its median run) and for the default fleet, torch marked."""
    split = json.loads((RESULTS.parent / "split_host.json").read_text(encoding="utf-8"))
    split["fast"]["contenders"]["router 2"]["median_run"]["rss_mb"] = {"engine": 310, "front 1": 95, "parent": 41}
    split["memory"] = {"fleet": "config/fleet.yaml", "workers": 2, "maps_torch": ["engine", "front 1"],
                       "rss_mb": {"engine": 1324, "front 1": 790, "parent": 41},
                       "own_mb": {"engine": {"uss": 870, "pss": 1010}, "front 1": {"uss": 330, "pss": 470}}}
    page = render({**small_results(), "scenarios": {"split": split}})
    assert " | engine 310, front 1 95, parent 41 |\n" in page
    assert "the default fleet (config/fleet.yaml) with workers 2" in page
    assert ("| engine | 1324 | 870 | 1010 | yes |\n| front 1 | 790 | 330 | 470 | yes |\n"
            "| parent | 41 | – | – | no |") in page  # a run that did not read a process's own memory: a dash
