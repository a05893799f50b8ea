"""Load for the end-to-end tests of the operators' view: a fleet with a model for each kind of
trouble, and closed-loop clients that post scripted-plugin requests to it until the block ends.

Its `cuda:0` is read by the real `NvmlProbe` through a stand-in NVML library (tests/fake_nvml):
95% of the memory used and every third read failing, so admission there pauses and its model's
requests expire (504). `hung` stalls its instance for 15 s once sent `{"id": "hang"}`. `split` has
two versions on a device of its own (`cuda:1`, read as host memory) so that its shadow copies find
the device idle between requests; version 2 answers otherwise, so its rollout is rolled back.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import httpx

from tests.conftest import REPO

__all__ = ["FLEET", "NVML", "TRAFFIC", "Answered", "Client", "traffic"]

FLEET = """
devices:
  cpu: {probe: host}
  cuda:0: {probe: nvml}
  cuda:1: {probe: host}
models:
  steady: {plugin: scripted, device: cpu, options: {fixed_ms: 10, per_item_ms: 1}, batch: {max_size: 8, max_delay_ms: 5}}
  slow: {plugin: scripted, device: cpu, options: {fixed_ms: 80}, batch: {max_size: 1}, queue: {max_size: 5, timeout_ms: 30000}}
  flaky: {plugin: scripted, device: cpu, options: {fixed_ms: 5, fail: marked}, batch: {max_size: 4, max_delay_ms: 2}}
  hung: {plugin: scripted, device: cpu, required: false, options: {hang_on: hang, hang_ms: 15000},
         execution: {timeout_ms: 200}}
  broken: {plugin: scripted, device: cpu, required: false, options: {load_error: "weights file is corrupt"}}
  pressed: {plugin: scripted, device: "cuda:0", required: false, memory: {profile: false}, queue: {timeout_ms: 300}}
  split: {plugin: scripted, device: "cuda:1", options: {fixed_ms: 2, label: a}, batch: {max_size: 4, max_delay_ms: 2},
          versions: {"1": {}, "2": {options: {label: b}}}, mirror: {version: "2", percent: 50},
          rollout: {candidate: "2", steps: [20, 100], step_min_s: 0, min_samples: 20}}
"""
NVML = {"PYTHONPATH": f"{REPO / 'tests' / 'fake_nvml'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
        "FAKE_NVML_USED_FRACTION": "0.95", "FAKE_NVML_FAIL_EVERY": "3"}


@dataclass(frozen=True)
class Client:
    model: str
    bad_every: int = 0  # every Nth request sends `bad_body` instead
    bad_body: bytes = b"{not json"
    pause_s: float = 0.0  # between requests; after a 503 at least 20 ms, so refused clients do not spin


@dataclass(frozen=True)
class Answered:
    """One answer the clients got: when (time.monotonic), from which model, its status."""

    at: float
    model: str
    status: int
    retry_after: str | None


@contextmanager
def traffic(url: str, clients: Sequence[Client], headers: dict[str, str] | None = None,
            answers: list[Answered] | None = None) -> Iterator[None]:
    """Closed-loop clients until the block ends; with `answers`, every answer is appended to it."""
    stop = threading.Event()

    def run(client: Client) -> None:
        with httpx.Client(base_url=url, timeout=10, headers={**(headers or {}), "Content-Type": "application/json"}) as http:
            i = 0
            while not stop.is_set():
                i += 1
                bad = client.bad_every and i % client.bad_every == 0
                body = client.bad_body if bad else f'{{"id": "{client.model}-{i}"}}'.encode()
                try:
                    answer = http.post(f"/models/{client.model}/predict", content=body)
                except httpx.HTTPError:
                    continue
                if answers is not None:
                    answers.append(Answered(time.monotonic(), client.model, answer.status_code,
                                            answer.headers.get("retry-after")))
                if client.pause_s or answer.status_code == 503:
                    stop.wait(max(client.pause_s, 0.02))

    threads = [threading.Thread(target=run, args=(client,), daemon=True) for client in clients]
    for thread in threads:
        thread.start()
    try:
        yield
    finally:
        stop.set()
        for thread in threads:
            thread.join(15)


TRAFFIC = [*(Client("steady", bad_every=10) for _ in range(3)),
           Client("flaky", bad_every=3, bad_body=b'{"id": "fail-now"}', pause_s=0.05),
           *(Client("slow") for _ in range(8)),  # 1 running, 5 queued, the rest refused
           Client("broken", pause_s=0.2), Client("pressed", pause_s=0.1),
           Client("split", pause_s=0.02)]  # versions on a device of their own: copies find it idle
