"""Memory after a burst of large bodies, against a real server under an address-space limit:
64 concurrent 15 MB bodies, then the resident size once the burst is over. glibc keeps freed
memory; the router trims it after bursts (MODEL_ROUTER_TRIM_MEMORY, on by default)."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tests.conftest import HANG_S, RouterProcess, serve

pytestmark = [pytest.mark.e2e, pytest.mark.load]

FLEET = """
models:
  echo:
    plugin: scripted
    queue: {timeout_ms: 120000}  # every body is read and served, however slow the shared cores
    batch: {max_size: 8, max_delay_ms: 2}
"""
MB = 1024 * 1024
BODY = b"\x00" * (15 * MB)
#: What may stay resident after the burst, over the resident size before it.
SETTLED_GROWTH_BOUND = 300 * MB


def burst(server: RouterProcess, count: int = 64) -> tuple[list[int], int]:
    """`count` concurrent 15 MB bodies; their statuses and the peak resident size seen meanwhile."""
    peak = server.rss()
    done = threading.Event()

    def sample() -> None:
        nonlocal peak
        while not done.is_set():
            peak = max(peak, server.rss())
            time.sleep(0.02)

    sampler = threading.Thread(target=sample)
    sampler.start()
    with httpx.Client(base_url=server.url, timeout=120, limits=httpx.Limits(max_connections=count)) as client, \
            ThreadPoolExecutor(count) as pool:
        statuses = list(pool.map(lambda _: client.post("/models/echo/predict", content=BODY, headers={
            "content-type": "application/octet-stream"}).status_code, range(count)))
    done.set()
    sampler.join()
    return statuses, peak


def settled_rss(server: RouterProcess, before: int) -> int:
    """The resident size once it has come back within the bound of `before` (the router trims
    every second), or after HANG_S if it never does."""
    deadline = time.monotonic() + HANG_S
    while (rss := server.rss()) - before >= SETTLED_GROWTH_BOUND and time.monotonic() < deadline:
        time.sleep(0.25)
    return rss


def measure(tmp_path: Path, trim: bool) -> dict[str, float]:
    env = {"MODEL_ROUTER_TRIM_MEMORY": "true" if trim else "false"}
    with serve(tmp_path, FLEET, env=env, memory_limit=12 * 1024 * MB) as server:
        httpx.post(server.url + "/models/echo/predict", content=b"warm", timeout=10)
        before = server.rss()
        statuses, peak = burst(server)
        after = settled_rss(server, before)
        statuses_again, peak_again = burst(server)
        after_again = settled_rss(server, before)
    assert set(statuses) | set(statuses_again) <= {200, 503, 504}, (statuses, statuses_again)
    return {"before_mb": before / MB, "peak_mb": peak / MB, "after_mb": after / MB,
            "second_peak_mb": peak_again / MB, "after_second_mb": after_again / MB, "ok": statuses.count(200)}


def test_memory_is_handed_back_after_bursts_of_large_bodies(tmp_path: Path) -> None:
    figures = measure(tmp_path, trim=True)
    print(f"\nRSS with trimming: {figures}")
    assert figures["ok"] >= 48, figures  # the burst was served, not refused before its bodies were read
    assert (figures["after_mb"] - figures["before_mb"]) * MB < SETTLED_GROWTH_BOUND, figures
    assert (figures["after_second_mb"] - figures["before_mb"]) * MB < SETTLED_GROWTH_BOUND, figures
