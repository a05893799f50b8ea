"""The fault drill, against a real server under load: the process of an isolated model's instance
killed (`kill -9`) or stopped (SIGSTOP), with a healthy model on the same CPU device beside it.

The neighbour answers 200 throughout. The victim answers only 503 with Retry-After (or 504) while
it is down, never 500; a dead process is reaped, reported once, shown in readiness and restarted;
a stopped one fences its model until it runs again. An unload also waits for the answers its
instance gave to be postprocessed (an eviction racing postprocessing answered 500).

`served` starts the server, once per layout (`TOPOLOGIES`): one process, and a split host of two
fronts and an engine; the drills read the server only through it. A front or the engine as the
victim: tests/e2e/test_split_host.py.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import psutil
import pytest

from tests.conftest import RouterProcess, read_records, serve
from tests.traffic import Answered, Client, traffic

pytestmark = pytest.mark.e2e

FLEET = """
models:
  victim:
    plugin: scripted
    isolation: process
    options: {{fixed_ms: 5, load_ms: 1500}}
    batch: {{max_size: 4, max_delay_ms: 2}}
    execution: {{timeout_ms: 400}}
    queue: {{timeout_ms: 1000}}
    warmup: {{enabled: false}}
  neighbour:
    plugin: scripted
    options: {{fixed_ms: 5}}
    batch: {{max_size: 4, max_delay_ms: 2}}
    queue: {{timeout_ms: 3000}}
  slowpost:
    plugin: scripted
    required: false
    options: {{post_ms: 800, record: "{record}"}}
    batch: {{max_size: 1}}
"""
CLIENTS = [Client("victim"), Client("victim"), Client("neighbour"), Client("neighbour")]
#: The layouts drilled: one process, and two HTTP fronts with an engine (the victim's instance
#: process is then the engine's child; the answers are the fronts').
TOPOLOGIES = {"one process": {}, "two fronts and an engine": {"MODEL_ROUTER_WORKERS": "2"}}


@dataclass
class Served:
    server: RouterProcess
    record: Path

    def victim_process(self) -> psutil.Process:
        """The process that runs the victim's instance (a descendant of the server)."""
        children = psutil.Process(self.server.process.pid).children(recursive=True)
        [child] = [c for c in children if "router.serving.isolation" in " ".join(c.cmdline())]
        return child


@pytest.fixture(scope="module", params=list(TOPOLOGIES))
def served(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    tmp = tmp_path_factory.mktemp("drill")
    record = tmp / "batches.jsonl"
    with serve(tmp, FLEET.format(record=record), timeout=60, env=TOPOLOGIES[request.param]) as server:
        yield Served(server, record)


def until(condition: Callable[[], bool], timeout: float, every: float = 0.01) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(every)
    return condition()


def answered(answers: list[Answered], model: str, since: float, status: int | None = None) -> list[Answered]:
    return [a for a in list(answers) if a.model == model and a.at >= since and (status is None or a.status == status)]


def assert_refused_properly(answers: list[Answered]) -> None:
    """While down, the victim answers 503 with Retry-After, or 504: never a 500."""
    statuses = {a.status for a in answers}
    assert statuses <= {200, 503, 504}, statuses
    assert all(a.retry_after for a in answers if a.status == 503)


def test_a_killed_instance_process_is_reaped_reported_and_restarted(served: Served) -> None:
    server, child = served.server, served.victim_process()
    answers: list[Answered] = []
    with traffic(server.url, CLIENTS, answers=answers):
        assert until(lambda: answered(answers, "victim", 0, 200) and answered(answers, "neighbour", 0, 200), 10)
        killed_at = time.monotonic()
        child.kill()
        # Its restart takes the 1.5 s of its load: readiness says so meanwhile.
        assert until(lambda: httpx.get(server.url + "/health/ready").status_code == 503, 1.5)
        assert httpx.get(server.url + "/v2/models/victim/ready").status_code == 400
        refused = httpx.post(server.url + "/models/victim/predict", json={"id": "while-down"})
        assert refused.status_code == 503 and int(refused.headers["retry-after"]) >= 1, refused.text
        assert "is restarting" in refused.json()["detail"]
        assert until(lambda: httpx.get(server.url + "/health/ready").status_code == 200, 20, every=0.1)
        back_at = time.monotonic()
        assert until(lambda: answered(answers, "victim", back_at, 200), 10)
    assert not child.is_running(), "the killed process was left a zombie"
    assert_refused_properly(answered(answers, "victim", killed_at))
    neighbour = answered(answers, "neighbour", killed_at)
    assert {a.status for a in neighbour} == {200} and len(answered(answers, "neighbour", killed_at, 200)) > 10
    model = httpx.get(server.url + "/models/victim").json()
    assert model["state"] == "ready" and model["residency"]["restarts"] >= 1 and model["residency"]["lost"] is None
    assert served.victim_process().pid != child.pid
    said = [r for r in server.log_records() if r.get("level") == "error" and f"process {child.pid} died" in str(r["message"])]
    assert [r["message"] for r in said] == [(f"model victim instance 0: its instance process {child.pid} died "
                                             "(killed by SIGKILL); loading it again")]


def test_a_stopped_instance_process_costs_only_its_own_model(served: Served) -> None:
    server, child = served.server, served.victim_process()
    answers: list[Answered] = []
    with traffic(server.url, CLIENTS, answers=answers):
        assert until(lambda: answered(answers, "victim", 0, 200) and answered(answers, "neighbour", 0, 200), 10)
        child.suspend()
        stopped_at = time.monotonic()
        try:
            fenced_by = stopped_at + 1.0  # the execution timeout (0.4 s) and a margin: the victim is fenced
            # The neighbour on the same device goes on answering while the victim stays stopped.
            assert until(lambda: len(answered(answers, "neighbour", fenced_by, 200)) >= 20, 10), \
                "the neighbour served nothing while its device's other model was stopped"
            assert until(lambda: answered(answers, "victim", fenced_by), 5)
            resumed_at = time.monotonic()
        finally:
            child.resume()
        assert until(lambda: answered(answers, "victim", resumed_at + 0.1, 200), 10)
    down = [a for a in answered(answers, "victim", fenced_by) if a.at < resumed_at]
    assert down and {a.status for a in down} <= {503, 504}
    assert_refused_properly(down)
    assert {a.status for a in answered(answers, "neighbour", stopped_at)} == {200}
    assert until(lambda: httpx.get(server.url + "/models/victim").json()["state"] == "ready", 5, every=0.1)
    assert child.is_running() and served.victim_process().pid == child.pid  # recovered, not restarted


def test_an_unload_waits_for_the_answers_its_instance_gave(served: Served) -> None:
    """Postprocessing (0.8 s here) runs after the batch; an unload must not pull the model from under it."""
    server = served.server
    result: list[httpx.Response] = []
    asking = threading.Thread(target=lambda: result.append(httpx.post(
        server.url + "/models/slowpost/predict", json={"id": "postprocessed"}, timeout=30)))
    asking.start()
    try:
        assert until(lambda: any("postprocessed" in r["ids"] for r in read_records(served.record)), 10)
        unloaded = httpx.post(server.url + "/models/slowpost/unload", timeout=30)
        assert unloaded.status_code == 200, unloaded.text
    finally:
        asking.join(30)
    [answer] = result
    assert answer.status_code == 200, answer.text
    assert answer.json()["result"]["id"] == "postprocessed"
    assert httpx.post(server.url + "/models/slowpost/load", timeout=30).status_code == 200
