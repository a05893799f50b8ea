"""The files in deploy/: promtool checks the rules and the configuration and runs the alert unit
tests; the dashboard is well formed. The e2e test runs them against a real router and Prometheus."""

from __future__ import annotations

import subprocess

from tests.deploy_files import ALERTS, DEPLOY, RULES, alert_rules, dashboard, dashboard_queries, recording_rules
from tests.tools import require_program

PROMETHEUS = DEPLOY / "prometheus"


def promtool(*args: str) -> str:
    done = subprocess.run([require_program("promtool", "prometheus"), *args], cwd=PROMETHEUS, capture_output=True,
                          text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout + done.stderr


def test_promtool_checks_the_rules_and_the_configuration() -> None:
    assert "SUCCESS" in promtool("check", "rules", str(RULES), str(ALERTS))
    assert "SUCCESS" in promtool("check", "config", "prometheus.yml")


def test_every_alert_fires_on_synthetic_series() -> None:
    """promtool's rule unit tests, one or more per alert, the scheduler restart included."""
    promtool("test", "rules", "alerts.test.yml")
    tested = (PROMETHEUS / "alerts.test.yml").read_text(encoding="utf-8")
    assert all(f"alertname: {rule['alert']}" in tested for rule in alert_rules())


def test_every_alert_has_a_summary_and_a_runbook_line_in_the_operators_guide() -> None:
    guide = (DEPLOY.parent / "docs" / "operating.md").read_text(encoding="utf-8")
    for rule in alert_rules():
        assert rule["annotations"]["summary"] and rule["labels"]["severity"] in ("warning", "critical")
        assert rule["annotations"]["runbook"] == f"docs/operating.md, Alerts > {rule['alert']}"
        assert f"**{rule['alert']}**" in guide, f"docs/operating.md has no runbook line for {rule['alert']}"


def test_recording_rules_follow_the_naming_convention() -> None:
    for rule in recording_rules():
        level, metric, operation = rule["record"].split(":")
        assert level in ("model", "device", "instance") and metric.startswith("model_router_") and operation


def test_the_dashboard_is_a_grafana_10_dashboard_over_one_datasource_variable() -> None:
    board = dashboard()
    assert board["schemaVersion"] >= 38 and board["uid"] == "model-router"
    variables = {v["name"] for v in board["templating"]["list"]}
    assert variables == {"datasource", "job", "instance", "model", "device"}
    ids = [panel["id"] for panel in board["panels"]]
    assert len(ids) == len(set(ids))
    for panel in board["panels"]:
        position = panel["gridPos"]
        assert position["x"] + position["w"] <= 24, panel["title"]
        if panel["type"] == "row":
            continue
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
        assert panel["targets"] and panel["description"], panel["title"]
    used = {name for _, expr in dashboard_queries() for name in ("job", "instance", "model", "device") if f"${name}" in expr}
    assert used == variables - {"datasource"}
