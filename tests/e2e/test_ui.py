"""The live page in a real browser (headless Chromium) against a real router under load, with API
keys set (the load of tests/traffic.py): the page asks for a key, then shows numbers that change
while the load runs and that agree with GET /models once it stops. Saves a screenshot to reports/ui.png (docs/ui.png, which
docs/operating.md shows, is a copy of one)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from PIL import Image

from tests.conftest import REPO, serve
from tests.tools import require_program
from tests.traffic import FLEET, NVML, TRAFFIC, traffic

pytestmark = [pytest.mark.e2e]

KEY = "ui-test-key-0123456789"
# The page's columns: outcome counters grouped by the status they answer with (an independent copy).
STATUS = {"ok": "200", "bad_input": "4xx", "rejected_full": "503", "unavailable": "503", "rejected_shutdown": "503",
          "out_of_memory": "503", "deadline": "504", "execution_timeout": "504", "error": "500", "cancelled": "499"}
# Every data-field of every card, as shown (bytes and counts also as their raw value).
READ_PAGE = """(() => {
  const read = (selector, key) => Object.fromEntries([...document.querySelectorAll(selector)].map((card) => [
    card.dataset[key], Object.fromEntries([...card.querySelectorAll('[data-field]')].map(
      (n) => [n.dataset.field, n.dataset.value ?? n.textContent]))]));
  return {models: read('[data-model]', 'model'), devices: read('[data-device]', 'device')};
})()"""


def test_the_live_page_in_a_browser(tmp_path: Path) -> None:
    require_program("chromium", "chromium")
    from benchmarks.browser import Browser

    auth = {"Authorization": f"Bearer {KEY}"}
    with serve(tmp_path, FLEET, env={**NVML, "MODEL_ROUTER_API_KEYS": KEY}) as router, Browser(width=1500, height=900) as browser:
        assert httpx.get(f"{router.url}/ui/state").status_code == 401
        assert httpx.get(f"{router.url}/ui").status_code == 200  # the page holds no data: open
        browser.goto(f"{router.url}/ui")
        browser.wait_for("!document.getElementById('key-form').hidden")
        assert "key" in browser.evaluate("document.getElementById('status').textContent")
        browser.evaluate(f"document.getElementById('key').value = {json.dumps(KEY)}; "
                         "document.getElementById('key-form').requestSubmit(); true")
        with traffic(router.url, TRAFFIC, headers=auth):
            httpx.post(f"{router.url}/models/hung/predict", json={"id": "hang"}, headers=auth, timeout=10)
            browser.wait_for("Number(document.querySelector('[data-model=steady] [data-field=total-200]')"
                             "?.textContent) > 0 && document.querySelector('[data-model=hung] [data-field=state]')"
                             ".textContent === 'degraded'")
            first = browser.evaluate(READ_PAGE)
            depths = [int(browser.evaluate(READ_PAGE)["models"]["slow"]["queue-depth"]) for _ in range(3)]
            time.sleep(8)  # some history for the charts
            second = browser.evaluate(READ_PAGE)
            browser.screenshot(_report("ui.png"))
        _shrink(_report("ui.png"))
        page = _settled(browser, router.url, auth)
        residency = _with_residency_fields(browser)
    steady = (first["models"]["steady"], second["models"]["steady"])
    assert int(steady[1]["total-200"]) > int(steady[0]["total-200"]) and int(steady[1]["total-4xx"]) > 0
    assert steady[1]["rate-200"] not in ("–", "0.0") and steady[1]["p99"] != "–" and steady[1]["wait-p50"] != "–"
    assert max(depths) >= 1 and int(second["models"]["slow"]["total-503"]) > 0
    assert int(second["models"]["flaky"]["total-500"]) > 0 and int(second["models"]["pressed"]["total-504"]) > 0
    assert second["devices"]["cuda:0"]["admission"] == "true" and second["devices"]["cpu"]["admission"] == "false"
    assert page["models"]["broken"]["state"] == "failed" and "corrupt" in page["models"]["broken"]["error"]
    assert int(second["devices"]["cuda:0"]["probe-errors"]) > 0  # and `hung` was shown degraded
    assert residency == {"residency-residency": "resident", "residency-loads": "3", "residency-evictions": "1"}


def _settled(browser: Any, url: str, auth: dict[str, str]) -> dict[str, Any]:
    """Once the load has stopped: what the page shows equals what GET /models says."""
    deadline = time.monotonic() + 15
    while True:
        models = {m["name"]: m for m in httpx.get(f"{url}/models", headers=auth).json()["models"]}
        page = browser.evaluate(READ_PAGE)
        differences = _differences(page, models)
        if not differences:
            return page  # type: ignore[no-any-return]
        assert time.monotonic() < deadline, f"the page disagrees with /models: {differences}"
        time.sleep(0.5)


def _differences(page: dict[str, Any], models: dict[str, Any]) -> list[str]:
    out = []
    assert set(page["models"]) == set(models)
    for name, model in models.items():
        shown = page["models"][name]
        totals: dict[str, int] = {}
        for outcome, count in model["requests"].items():
            totals[STATUS.get(outcome, "other")] = totals.get(STATUS.get(outcome, "other"), 0) + count
        expected = {"state": model["state"], "queue-depth": str(model["queue"]["depth"]),
                    "queue-capacity": str(model["queue"]["capacity"]),
                    **{f"total-{s}": str(totals.get(s, 0)) for s in ("200", "4xx", "503", "504", "500", "499", "other")}}
        out += [f"{name} {field}: page {shown[field]}, /models {value}"
                for field, value in expected.items() if shown[field] != value]
    weights = sum(i["memory"]["weights_bytes"] for m in models.values() for i in m["instances"]
                  if i["device"] == "cpu" and i["memory"] and i["state"] == "ready")
    if page["devices"]["cpu"]["weights"] != str(weights):
        out.append(f"cpu ledger weights: page {page['devices']['cpu']['weights']}, /models {weights}")
    return out


def _with_residency_fields(browser: Any) -> dict[str, str]:
    """What the page shows once model snapshots carry a dynamic fleet's fields (added here in the page's
    own fetch, as the router does not report them yet)."""
    browser.evaluate("""(() => {
      const fetchState = window.fetch;
      window.fetch = async (...args) => {
        const state = await (await fetchState(...args)).json();
        Object.assign(state.models.find((m) => m.name === 'steady'), {residency: 'resident', loads: 3, evictions: 1});
        return new Response(JSON.stringify(state), {status: 200, headers: {'Content-Type': 'application/json'}});
      };
      return true;
    })()""")
    browser.wait_for("!!document.querySelector('[data-model=steady] [data-field=residency-loads]')")
    fields = browser.evaluate(READ_PAGE)["models"]["steady"]
    return {key: value for key, value in fields.items() if key.startswith("residency-")}


def _report(name: str) -> Path:
    reports = REPO / "reports"
    reports.mkdir(exist_ok=True)
    return reports / name


def _shrink(path: Path) -> None:
    """A 64-colour palette: a few tens of KB for docs/ instead of a few hundred."""
    with Image.open(path) as image:
        image.convert("RGB").quantize(colors=64).save(path, optimize=True)
