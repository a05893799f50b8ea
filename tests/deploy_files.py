"""The files in deploy/, read the way the tests need them: every dashboard query, every rule."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import yaml

from tests.conftest import REPO

__all__ = ["ALERTS", "DASHBOARD", "DEPLOY", "RULES", "alert_rules", "concrete", "dashboard", "dashboard_queries",
           "recording_rules"]

DEPLOY = REPO / "deploy"
DASHBOARD = DEPLOY / "grafana" / "model-router.json"
RULES = DEPLOY / "prometheus" / "rules.yml"
ALERTS = DEPLOY / "prometheus" / "alerts.yml"
VARIABLES = re.compile(r"\$(?:\{(\w+)\}|(\w+))")


def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text(encoding="utf-8"))  # type: ignore[no-any-return]


def dashboard_queries() -> list[tuple[str, str]]:
    """(panel title, PromQL) for every query of every panel."""
    return [(panel["title"], target["expr"]) for panel in dashboard()["panels"] for target in panel.get("targets", [])]


def concrete(expr: str, rate_interval: str = "30s") -> str:
    """A dashboard query as Prometheus can run it: every variable selects all, `$__rate_interval` is fixed."""
    def value(match: re.Match[str]) -> str:
        name = match.group(1) or match.group(2)
        return rate_interval if name == "__rate_interval" else ".*"
    return VARIABLES.sub(value, expr)


def _rules(path: Path) -> list[dict[str, Any]]:
    document = yaml.safe_load(path.read_text(encoding="utf-8"))
    return [rule for group in document["groups"] for rule in group["rules"]]


def recording_rules() -> list[dict[str, Any]]:
    return _rules(RULES)


def alert_rules() -> list[dict[str, Any]]:
    return _rules(ALERTS)
