"""The cluster on a real local Ray cluster of two "GPU hosts" (see conftest): throughput of two
device replicas against one, the latency the cluster path adds, four on-demand models of which
two fit per replica, a replica killed under load, and autoscaling under a surge."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.cluster.conftest import (
    cluster_models,
    cluster_section,
    deployed,
    free_port,
    loadgen,
    replicas_view,
    wait_until,
)
from tests.conftest import REPO, serve

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(240)]

JSON = 'application/json:{"id": "x"}'
#: The simulated accelerator: a batch of n costs 200 + 2 n ms (GIL released): 121 items/s per
#: replica at batches of 32, slow enough that 2 shared cores carry two replicas' HTTP and Ray traffic.
ACCEL = """  accel:
    plugin: scripted
    options: {fixed_ms: 200, per_item_ms: 2}
    batch: {max_size: 32, max_delay_ms: 5}
    queue: {max_size: 256}
"""
NOOP = """  noop:
    plugin: scripted
    batch: {max_size: 8, max_delay_ms: 0}
"""


def accel_fleet(port: int, replicas: int) -> str:
    return (f"model_store: {REPO / 'model_store'}\ndevices:\n  cpu: {{probe: none, memory_budget: 200MB}}\n"
            f"models:\n{ACCEL}{NOOP}"
            + cluster_section(port, f"{{min: {replicas}, max: {replicas}}}",
                              f"{{accel: {{min: {replicas}, max: {replicas}}}, noop: {{min: 1, max: 1}}}}"))


def copies(url: str, model: str) -> int:
    return int(cluster_models(url)[model]["cluster"]["copies"])


def test_two_device_replicas_serve_at_least_1_6x_one(tmp_path: Path, ray_cluster: Any) -> None:
    rates = {}
    for replicas in (1, 2):
        with deployed(tmp_path, accel_fleet(free_port(), replicas)) as url:
            wait_until(lambda: copies(url, "accel") == replicas, 60)
            loadgen(url, [f"/models/accel/predict={JSON}"], "--concurrency", "128", "--duration", "1.5")
            report = loadgen(url, [f"/models/accel/predict={JSON}"], "--concurrency", "128", "--duration", "6",
                             "--timeout", "30")
            assert report["statuses"] == {"200": report["requests"]}, report["statuses"]
            rates[replicas] = report["throughput_rps"]
    print(f"\ncluster throughput at concurrency 128: one replica {rates[1]} rps, two {rates[2]} rps, "
          f"ratio {rates[2] / rates[1]:.2f}")
    assert rates[2] >= 1.6 * rates[1], rates


def test_the_cluster_path_adds_little_latency_at_concurrency_1(tmp_path: Path, ray_cluster: Any) -> None:
    target = [f"/models/noop/predict={JSON}"]
    fleet = accel_fleet(free_port(), 1)
    with deployed(tmp_path, fleet) as url:
        loadgen(url, target, "--concurrency", "1", "--duration", "1")
        cluster = loadgen(url, target, "--concurrency", "1", "--duration", "4")
    with serve(tmp_path, fleet) as single:  # the same fleet in one process (the cluster section is unused)
        loadgen(single.url, target, "--concurrency", "1", "--duration", "1")
        alone = loadgen(single.url, target, "--concurrency", "1", "--duration", "4")
    added = cluster["ok_ms"]["p50"] - alone["ok_ms"]["p50"]
    print(f"\nno-op model at concurrency 1: single process p50 {alone['ok_ms']['p50']} ms, cluster p50 "
          f"{cluster['ok_ms']['p50']} ms: added {added:.2f} ms (goal <= 3 ms)")
    assert cluster["statuses"] == {"200": cluster["requests"]}
    assert added <= 10.0  # the goal is 3 ms, not met here (README, "Scale out"); this bounds regressions


FOUR = "".join(f"""  m{i}:
    plugin: scripted
    options: {{fixed_ms: 20, per_item_ms: 1, load_ms: 300, weights_bytes: 40000000}}
    residency: on_demand
    batch: {{max_size: 8, max_delay_ms: 2}}
    queue: {{max_size: 64, timeout_ms: 10000}}
""" for i in range(4))


@pytest.fixture(scope="module")
def four_models(tmp_path_factory: pytest.TempPathFactory, ray_cluster: Any) -> Any:
    """Four on-demand models of 40 MB under a 100 MB budget per replica: two fit on each."""
    fleet = (f"model_store: {REPO / 'model_store'}\ndevices:\n  cpu: {{probe: none, memory_budget: 100MB}}\n"
             f"models:\n{FOUR}" + cluster_section(free_port(), "{min: 2, max: 2}", "{}",
                                                   "{copy_target_in_flight: 1000}"))
    with deployed(tmp_path_factory.mktemp("four"), fleet) as url:
        yield url


def counters(url: str) -> tuple[int, int]:
    """(answered 200, of which waited for a load), over the four models, as the front counted them."""
    models = cluster_models(url)
    return (sum(m["requests"].get("ok", 0) for m in models.values()),
            sum(m["cluster"]["cold_requests"] for m in models.values()))


def test_four_on_demand_models_two_per_replica_round_robin(four_models: str) -> None:
    url = four_models
    targets = [f"/models/m{i}/predict={JSON}" for i in range(4)]
    warm = loadgen(url, targets, "--concurrency", "16", "--cycle", "--duration", "4", "--timeout", "30")
    ok_before, cold_before = counters(url)
    steady = loadgen(url, targets, "--concurrency", "16", "--cycle", "--duration", "8", "--timeout", "30")
    ok_after, cold_after = counters(url)
    models = cluster_models(url)
    hit = 1 - (cold_after - cold_before) / max(1, ok_after - ok_before)
    where = {name: m["cluster"]["resident_on"] for name, m in models.items()}
    serving = {replica for m in models.values() for replica, r in m["cluster"]["replicas"].items()
               if r["requests"].get("ok", 0) > 0}
    print(f"\nround robin over four models, two per replica: warm-up {warm['statuses']}, steady {steady['statuses']} "
          f"at {steady['throughput_rps']} rps, served without a load {hit:.3f}, resident {where}")
    assert warm["statuses"] == {"200": warm["requests"]} and steady["statuses"] == {"200": steady["requests"]}
    assert len(serving) == 2, where  # both replicas serve
    assert hit >= 0.95, (cold_after - cold_before, ok_after - ok_before)


async def _traffic(url: str, seconds: float, concurrency: int, client_timeout: float) -> list[tuple[float, float, int]]:
    """(start, end, status) of every request, round robin over the four models; 0 = no answer."""
    results: list[tuple[float, float, int]] = []
    stop = time.monotonic() + seconds

    async def worker(index: int, client: httpx.AsyncClient) -> None:
        turn = index
        while time.monotonic() < stop:
            started = time.monotonic()
            try:
                reply = await client.post(f"{url}/models/m{turn % 4}/predict", content=b'{"id": "k"}',
                                          headers={"content-type": "application/json", "X-Timeout-Ms": "5000"})
                status = reply.status_code
            except httpx.HTTPError:
                status = 0
            results.append((started, time.monotonic(), status))
            turn += 1

    async with httpx.AsyncClient(timeout=client_timeout) as client:
        await asyncio.gather(*(worker(i, client) for i in range(concurrency)))
    return results


def test_a_replica_killed_under_load(four_models: str) -> None:
    url = four_models
    victim = replicas_view()[0]
    killed_at: list[float] = []

    def kill() -> None:
        time.sleep(4)
        killed_at.append(time.monotonic())
        os.kill(victim.pid, signal.SIGKILL)

    killer = threading.Thread(target=kill)
    killer.start()
    results = asyncio.run(_traffic(url, 30, 8, client_timeout=12))
    killer.join()
    kill_time = killed_at[0]
    statuses = {s for _, _, s in results}
    bad = [end for _, end, status in results if status != 200 and end >= kill_time]
    restored_s = (max(bad) - kill_time) if bad else 0.0
    back_s = wait_until(lambda: len(replicas_view()) == 2 and victim.replica not in {r.replica for r in replicas_view()},
                        60)
    counts = {s: sum(1 for *_, x in results if x == s) for s in sorted(statuses)}
    print(f"\nreplica {victim.replica} killed under load: statuses {json.dumps(counts)}; every request answered 200 "
          f"again {restored_s:.1f} s after the kill; a new replica reporting {back_s:.1f} s after the traffic")
    assert statuses <= {200, 503, 504}, counts  # and none unanswered (0) within the client timeout
    assert restored_s <= 20.0
    late = [status for start, _, status in results if start >= kill_time + 20]
    assert late and set(late) == {200}


def test_replicas_scale_up_under_a_surge_and_back_down_after(tmp_path: Path, ray_cluster: Any) -> None:
    scaling = ("{target_ongoing_requests: 8, upscale_delay_s: 1, downscale_delay_s: 4, metrics_interval_s: 0.5, "
               "copy_target_in_flight: 8, copy_idle_s: 3}")
    fleet = (f"model_store: {REPO / 'model_store'}\ndevices:\n  cpu: {{probe: none, memory_budget: 200MB}}\n"
             f"models:\n{ACCEL}" + cluster_section(free_port(), "{min: 1, max: 2}", "{accel: {min: 1, max: 2}}", scaling))
    seen: list[tuple[float, int, int]] = []  # (time, replicas, copies of accel)
    with deployed(tmp_path, fleet) as url:
        done = threading.Event()

        def watch() -> None:
            while not done.is_set():
                reports = replicas_view()
                seen.append((time.monotonic(), len(reports),
                             sum(1 for r in reports if r.loads.get("accel") and r.loads["accel"].resident)))
                time.sleep(0.5)

        watcher = threading.Thread(target=watch)
        watcher.start()
        started = time.monotonic()
        surge = loadgen(url, [f"/models/accel/predict={JSON}"], "--concurrency", "64", "--duration", "15",
                        "--timeout", "30")
        ended = time.monotonic()
        try:
            down_s = wait_until(lambda: seen[-1][1] == 1, 60)
        finally:
            done.set()
            watcher.join()
    up = next((t - started for t, n, _ in seen if n == 2 and t >= started), None)
    both = any(c == 2 for t, _, c in seen if started <= t <= ended)
    print(f"\nautoscaling 1..2 replicas: surge {surge['statuses']} at {surge['throughput_rps']} rps; second replica "
          f"after {up} s; accel on both: {both}; back to one replica {down_s:.1f} s after the surge")
    assert surge["statuses"] == {"200": surge["requests"]}
    assert up is not None and both
    assert max(n for _, n, _ in seen) <= 2 and min(n for _, n, _ in seen if n) >= 1


def test_a_pipeline_runs_in_the_front_and_its_crops_cross_to_the_replicas(tmp_path: Path, ray_cluster: Any) -> None:
    """Each crop goes through Ray's handle to a device replica as decoded pixels, never re-encoded."""
    fleet = (f"model_store: {REPO / 'model_store'}\ndevices:\n  cpu: {{probe: none, memory_budget: 200MB}}\n"
             "models:\n  boxes: {plugin: boxes, options: {boxes: [[0, 0, 10, 10, 0.9], [10, 0, 30, 20, 0.8]]}}\n"
             "  pixels: {plugin: pixels}\n"
             "pipelines:\n  dc: {steps: [{model: boxes}, {transform: crop}, {model: pixels}]}\n"
             + cluster_section(free_port(), "{min: 1, max: 1}", "{boxes: {min: 1, max: 1}, pixels: {min: 1, max: 1}}"))
    from router.sdk.images import example_jpeg

    with deployed(tmp_path, fleet) as url:
        answer = httpx.post(url + "/models/dc/predict", content=example_jpeg(64, 48).body,
                            headers={"content-type": "image/jpeg"}, timeout=60)
        assert answer.status_code == 200, answer.text
        assert [d["pixels"]["width"] for d in answer.json()["result"]["detections"]] == [10, 20]
        assert cluster_models(url)["pixels"]["requests"] == {"ok": 2}
