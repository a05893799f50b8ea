"""The dynamic fleet against a real server: a fleet larger than its budget under round-robin
load, the admin API (with keys), SIGHUP, and Triton's repository extension through tritonclient."""

from __future__ import annotations

import json
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from tests.conftest import REPO, RouterProcess, metric_value, serve

pytestmark = pytest.mark.e2e

MB = 1_000_000
BUS_JPG = Path(__import__("ultralytics").__file__).parent / "assets" / "bus.jpg"
ADMIN = "admin-key-0123456789abcdef"
USER = "user-key-0123456789abcdef"

#: Three on-demand ResNet-18s and a YOLOv8n detector. Their measured weights are 46.8 MB each and
#: 12.6 MB: 153 MB together, over the 140 MB budget, in which two ResNets (and the detector) fit
#: but not three. The per-input costs are declared (the plugins' estimates are upper bounds for a
#: GPU) so that full batches fit beside two models.
BUDGET_MB = 140
ROUND_ROBIN_FLEET = f"""
model_store: {REPO / "model_store"}
devices:
  cpu: {{probe: none, memory_budget: {BUDGET_MB}MB}}
models:
""" + "".join(
    f"""  resnet-{i}:
    plugin: resnet
    options: {{weights: resnet18.pt}}
    residency: on_demand
    memory: {{per_item: 5MB}}
    queue: {{max_size: 64, timeout_ms: 60000}}
""" for i in range(3)
) + """  detector:
    plugin: yolo
    options: {model: yolov8n.pt}
    residency: on_demand
    memory: {per_item: 15MB}
    batch: {max_size: 4}
    queue: {max_size: 64, timeout_ms: 60000}
"""


class Sampler(threading.Thread):
    """After each eviction (seen in /metrics), the server's resident memory and its ledger."""

    def __init__(self, server: RouterProcess) -> None:
        super().__init__(daemon=True)
        self.server = server
        self.process = psutil.Process(server.process.pid)
        self.start_rss = self.process.memory_info().rss
        self.after_unloads: list[tuple[int, int]] = []  # (RSS above the start, ledger weights)
        self.done = threading.Event()

    def run(self) -> None:
        seen = 0.0
        while not self.done.wait(0.25):
            text = httpx.get(self.server.url + "/metrics", timeout=5).text
            evictions = sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                            if line.startswith("model_router_evictions_total{"))
            if evictions > seen:
                seen = evictions
                ledger = metric_value(text, "model_router_ledger_weights_bytes", device="cpu")
                self.after_unloads.append((self.process.memory_info().rss - self.start_rss, int(ledger)))


def test_a_fleet_larger_than_its_budget_serves_round_robin_traffic(tmp_path: Path) -> None:
    with serve(tmp_path, ROUND_ROBIN_FLEET, timeout=120) as server:
        targets = [f"--target=/models/resnet-{i}/predict=image/jpeg:@{BUS_JPG}" for i in range(3)]
        targets.append(f"--target=/models/detector/predict=image/jpeg:@{BUS_JPG}")
        sampler = Sampler(server)
        sampler.start()
        load = subprocess.run(
            [sys.executable, "-m", "benchmarks.loadgen", "--url", server.url, *targets, "--concurrency", "16",
             "--cycle", "--duration", "60", "--timeout", "90", "--per-target"],
            cwd=REPO, capture_output=True, text=True, timeout=300, check=True,
        )
        sampler.done.set()
        sampler.join()
        report = json.loads(load.stdout)
        metrics = httpx.get(server.url + "/metrics").text
        models = httpx.get(server.url + "/models").json()["models"]

    weights = {m["name"]: m["memory"]["weights_bytes"] for m in models}
    loads = {m["name"]: metric_value(metrics, "model_router_loads_total", device="cpu", model=m["name"], result="ok")
             for m in models}
    evictions = {m["name"]: sum(m["residency"]["evictions"].values()) for m in models}
    drift = [rss - ledger for rss, ledger in sampler.after_unloads]
    print("\nround robin:", json.dumps({"statuses": report["statuses"], "throughput_rps": report["throughput_rps"],
                                        "loads": loads, "evictions": evictions,
                                        "rss_minus_ledger_mb_after_unloads": [d >> 20 for d in drift]}))
    assert sum(weights.values()) > BUDGET_MB * MB  # the fleet does not fit at once
    assert report["statuses"] == {"200": report["requests"]}, report["statuses"]  # every request 200
    assert report["requests"] > 100
    assert sum(evictions.values()) >= 2 and sum(loads.values()) >= 4 + 2  # visible in /metrics
    assert sum(metric_value(metrics, "model_router_evictions_total", device="cpu", kind="lru", model=m)
               for m in weights) >= 2
    # After each unload the server's resident memory follows the ledger: what it holds above its
    # start is the booked weights plus torch's and ultralytics' one-time set-up (about 180 MB
    # here) and, when sampled, a running batch's activations and a load in flight (up to about
    # 400 MB for a YOLO batch of four at 640 px) — 640 MB in all, and never growing with loads.
    assert sampler.after_unloads, "no unload was sampled"
    assert all(-50 * MB < d < 640 * MB for d in drift), [d >> 20 for d in drift]
    third = max(1, len(drift) // 3)
    assert statistics.median(drift[-third:]) - statistics.median(drift[:third]) < 100 * MB  # no growth


def admin(server: RouterProcess, method: str, path: str, key: str | None = ADMIN,
          headers: dict[str, str] | None = None, **kwargs: Any) -> httpx.Response:
    sent = {**(headers or {}), **({"Authorization": f"Bearer {key}"} if key else {})}
    return httpx.request(method, server.url + path, headers=sent, timeout=60, **kwargs)


SCRIPTED = """
models:
  a: {plugin: scripted, options: {fixed_ms: 5}}
"""


def test_models_change_through_the_admin_api_with_admin_keys(tmp_path: Path) -> None:
    env = {"MODEL_ROUTER_API_KEYS": USER, "MODEL_ROUTER_ADMIN_KEYS": ADMIN}
    with serve(tmp_path, SCRIPTED, env=env) as server:
        section = "plugin: scripted\nresidency: on_demand\noptions: {fixed_ms: 5}\n"
        assert admin(server, "PUT", "/models/b", key=None, content=section).status_code == 401
        assert admin(server, "PUT", "/models/b", key=USER, content=section).status_code == 403
        added = admin(server, "PUT", "/models/b", content=section, headers={"content-type": "application/yaml"})
        assert added.status_code == 201 and added.json()["outcome"] == "added", added.text
        assert added.json()["model"]["state"] == "unloaded"
        bad = admin(server, "PUT", "/models/c", json={"plugin": "scripted", "options": {"fixed_mss": 1}})
        assert bad.status_code == 400 and "models.c.options.fixed_mss" in bad.json()["detail"]
        predict = httpx.post(server.url + "/models/b/predict", json={"id": "x"},
                             headers={"Authorization": f"Bearer {USER}"}, timeout=30)
        assert predict.status_code == 200 and predict.json()["result"]["id"] == "x"
        unloaded = admin(server, "POST", "/models/b/unload")
        assert unloaded.status_code == 200 and unloaded.json()["model"]["state"] == "unloaded"
        refused = httpx.post(server.url + "/models/b/predict", json={"id": "y"},
                             headers={"Authorization": f"Bearer {USER}"}, timeout=30)
        assert refused.status_code == 503 and "unloaded by an operator" in refused.json()["detail"]
        assert "retry-after" in refused.headers
        loaded = admin(server, "POST", "/models/b/load")
        assert loaded.status_code == 200 and loaded.json()["state"] == "ready"
        assert loaded.json()["residency"]["held"] is True and loaded.json()["residency"]["loads"] == 2
        assert admin(server, "DELETE", "/models/b").json() == {"deleted": "b"}
        assert httpx.post(server.url + "/models/b/predict", json={"id": "z"},
                          headers={"Authorization": f"Bearer {USER}"}).status_code == 404


def test_sighup_reloads_the_fleet_file(tmp_path: Path) -> None:
    with serve(tmp_path, SCRIPTED) as server:
        (tmp_path / "fleet.yaml").write_text(SCRIPTED + "  b: {plugin: scripted}\n", encoding="utf-8")
        server.process.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            reply = httpx.get(server.url + "/models/b")
            if reply.status_code == 200 and reply.json()["state"] == "ready":
                break
            time.sleep(0.1)
        assert httpx.post(server.url + "/models/b/predict", json={"id": "x"}).status_code == 200
        assert any(r.get("message", "").startswith("reload on SIGHUP: added ['b']") for r in server.log_records())
        (tmp_path / "fleet.yaml").write_text(SCRIPTED, encoding="utf-8")
        done = subprocess.run([sys.executable, "-m", "router", "reload", "--url", server.url], cwd=REPO,
                              capture_output=True, text=True, timeout=60, check=False)
        assert done.returncode == 0 and json.loads(done.stdout)["removed"] == ["b"], done.stdout + done.stderr


def test_tritonclient_loads_unloads_and_lists_the_repository(tmp_path: Path) -> None:
    fleet = SCRIPTED + "  lazy: {plugin: scripted, residency: on_demand}\n"
    with serve(tmp_path, fleet) as server:
        triton = httpclient.InferenceServerClient(server.url.removeprefix("http://"))
        index = {m["name"]: m for m in triton.get_model_repository_index()}
        assert index["a"]["state"] == "READY" and index["lazy"]["state"] == "UNAVAILABLE"
        triton.load_model("lazy")
        assert triton.is_model_ready("lazy")
        assert {m["name"]: m["state"] for m in triton.get_model_repository_index()}["lazy"] == "READY"
        triton.unload_model("a")
        assert not triton.is_model_ready("a")
        entry = {m["name"]: m for m in triton.get_model_repository_index()}["a"]
        assert entry["state"] == "UNAVAILABLE"
        with pytest.raises(InferenceServerException):
            triton.load_model("nope")
        triton.load_model("a")
        assert triton.is_model_ready("a")
