"""A real Prometheus scrapes a real router under load: every dashboard query and every recording
rule returns data, and every alert that load can cause without a GPU fires.

The load (tests/traffic.py) causes each kind of trouble, the memory and probe alerts' through a
stand-in NVML library. The alerts' `for:` durations are cut to 2 s and Prometheus scrapes and
evaluates every second. The one alert no load can cause (a scheduler crash) is proven by
promtool's unit tests (tests/test_deploy.py); here its expression's series must exist.
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from tests.conftest import free_port, serve
from tests.deploy_files import ALERTS, RULES, alert_rules, concrete, dashboard_queries, recording_rules
from tests.tools import require_program
from tests.traffic import FLEET, NVML, TRAFFIC, traffic

pytestmark = [pytest.mark.e2e]

# alert -> the labels it must fire with
EXPECTED = {
    "ModelRouterMemoryAboveHighWatermark": {"device": "cuda:0"},
    "ModelRouterAdmissionPaused": {"device": "cuda:0"},
    "ModelRouterProbeErrors": {"device": "cuda:0"},
    "ModelRouterQueueNearBound": {"model": "slow"},
    "ModelRouterRefusalRatioHigh": {"model": "broken"},
    "ModelRouterDeadlineMissRatioHigh": {"model": "pressed"},
    "ModelRouterModelFailed": {"model": "broken"},
    "ModelRouterModelNotReady": {"model": "hung", "state": "degraded"},
}
NOT_CAUSED = {"ModelRouterSchedulerRestarted": "increase(model_router_scheduler_restarts_total[10m])"}


def test_dashboard_and_rules_against_a_real_prometheus_and_router(tmp_path: Path) -> None:
    assert set(EXPECTED) | set(NOT_CAUSED) == {rule["alert"] for rule in alert_rules()}
    binary = require_program("prometheus", "prometheus")
    started = time.monotonic()
    with serve(tmp_path, FLEET, env=NVML) as router, traffic(router.url, TRAFFIC), \
            prometheus(binary, tmp_path, router.url.removeprefix("http://")) as api:
        httpx.post(f"{router.url}/models/hung/predict", json={"id": "hang"}, timeout=10)  # 504; stalls 15 s
        fired = wait_for_alerts(api, timeout_s=90)
        assert not missing(fired), f"not fired: {missing(fired)}; fired: {sorted(n for n, _ in fired)}"
        empty = [f"{title}: {expr}" for title, expr in dashboard_queries() if not query(api, concrete(expr))]
        empty += [rule["record"] for rule in recording_rules() if not query(api, rule["record"])]
        empty += [expr for expr in NOT_CAUSED.values() if not query(api, expr)]
        assert not empty, "no data for:\n" + "\n".join(empty)
    print(f"prometheus e2e: {len(dashboard_queries())} dashboard queries, {len(recording_rules())} recording rules, "
          f"{len(EXPECTED)} alerts fired, {time.monotonic() - started:.1f} s")


@contextmanager
def prometheus(binary: str, tmp_path: Path, target: str) -> Iterator[str]:
    """Prometheus on loopback scraping `target` every second, with the alerts' `for:` cut to 2 s."""
    rules = yaml.safe_load(ALERTS.read_text(encoding="utf-8"))
    for group in rules["groups"]:
        for rule in group["rules"]:
            if "for" in rule:
                rule["for"] = "2s"
    (tmp_path / "alerts.yml").write_text(yaml.safe_dump(rules), encoding="utf-8")
    config = {"global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
              "rule_files": [str(RULES), str(tmp_path / "alerts.yml")],
              "scrape_configs": [{"job_name": "model-router", "static_configs": [{"targets": [target]}]}]}
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config), encoding="utf-8")
    port = free_port()
    log = tmp_path / "prometheus.log"
    with open(log, "wb") as out:
        process = subprocess.Popen(
            [binary, f"--config.file={tmp_path / 'prometheus.yml'}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
             f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
            stdout=out, stderr=subprocess.STDOUT)
    api = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while not _ready(api):
            assert process.poll() is None and time.monotonic() < deadline, log.read_text(errors="replace")[-3000:]
            time.sleep(0.2)
        yield api
    finally:
        process.terminate()
        try:
            process.wait(15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(5)


def _ready(api: str) -> bool:
    try:
        return httpx.get(f"{api}/-/ready", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def wait_for_alerts(api: str, timeout_s: float) -> list[tuple[str, dict[str, str]]]:
    """Every alert seen firing, with its labels, until all expected ones have been or the time is up."""
    fired: set[tuple[str, frozenset[tuple[str, str]]]] = set()
    deadline = time.monotonic() + timeout_s
    while True:
        alerts = httpx.get(f"{api}/api/v1/alerts", timeout=5).json()["data"]["alerts"]
        fired |= {(a["labels"]["alertname"], frozenset(a["labels"].items())) for a in alerts if a["state"] == "firing"}
        seen = [(name, dict(labels)) for name, labels in fired]
        if not missing(seen) or time.monotonic() > deadline:
            return seen
        time.sleep(1)


def missing(fired: list[tuple[str, dict[str, str]]]) -> dict[str, dict[str, str]]:
    """The expected alerts not among those fired."""
    return {name: labels for name, labels in EXPECTED.items()
            if not any(name == n and labels.items() <= got.items() for n, got in fired)}


def query(api: str, expr: str) -> list[dict[str, Any]]:
    answer = httpx.get(f"{api}/api/v1/query", params={"query": expr}, timeout=10).json()
    assert answer["status"] == "success", f"{expr}: {answer}"
    return answer["data"]["result"]  # type: ignore[no-any-return]
