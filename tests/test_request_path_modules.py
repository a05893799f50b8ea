"""The modules of `router` a request meets, in one process, against the map in docs/architecture.md
("A predict, module by module"): the app in process around a real runtime, warmed, then one more
request recorded with a profile hook on every thread. The exact set is asserted, so a path that
grows or changes fails here until the map says so. A measurement of the path, not of its speed."""

from __future__ import annotations

import re
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import FrameType
from typing import Any

import pytest
from litestar.testing import TestClient

from router.http.app import create_app
from tests.test_runtime import make_runtime

REPO = Path(__file__).resolve().parents[1]
MAP = REPO / "docs" / "architecture.md"
HEADING = "### A predict, module by module"
FLEET = """
models:
  m: {plugin: scripted, options: {fixed_ms: 1}}
  v:
    plugin: scripted
    options: {fixed_ms: 1}
    versions: {"1": {}, "2": {}}
    traffic: {"1": 100}
pipelines:
  p: {steps: [{model: m}]}
"""
V2_BODY = {"inputs": [{"name": "JSON", "datatype": "BYTES", "shape": [1], "data": ['{"id": "a"}']}]}
#: The map's table rows (their first cell) and the request each one counts.
REQUESTS: dict[str, tuple[str, dict[str, Any]]] = {
    "native predict": ("/models/m/predict", {"id": "a"}),
    "native predict, a model with versions": ("/models/v/predict", {"id": "a"}),
    "V2 infer, a JSON input": ("/v2/models/m/infer", V2_BODY),
    "native predict, a pipeline of one step": ("/models/p/predict", {"id": "a"}),
}
WARM_UP = 5


def module_of(path: str) -> str:
    """`router/http/app.py` -> `router.http.app`; a package's `__init__.py` -> the package."""
    return path.removesuffix(".py").removesuffix("/__init__").replace("/", ".")


def the_map() -> tuple[list[str], dict[str, tuple[str, set[str], set[str]]]]:
    """The map's numbered list (the native predict's modules, in order) and, for each row of its
    table, its count, the modules besides the predict's and those it lacks (`less ...`)."""
    text = MAP.read_text(encoding="utf-8")
    assert HEADING in text, f"{MAP.name} has no section {HEADING!r}"
    section = text.split(HEADING, 1)[1].split("\n#", 1)[0]
    listed = [module_of(path) for path in re.findall(r"^\d+\. `(router/[\w/]+\.py)`", section, re.MULTILINE)]
    rows: dict[str, tuple[str, set[str], set[str]]] = {}
    for line in section.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if line.startswith("|") and cells[0] in REQUESTS:
            more, _, less = cells[2].partition("less ")
            rows[cells[0]] = (cells[1], {module_of(p) for p in re.findall(r"`(router/[\w/]+\.py)`", more)},
                              {module_of(p) for p in re.findall(r"`(router/[\w/]+\.py)`", less)})
    return listed, rows


class Recorder:
    """The `router` modules whose Python functions are called while `active`, on any thread
    started after `installed()` began (the runtime's loop, its CPU pool, its instances)."""

    def __init__(self) -> None:
        self.active = False
        self.modules: set[str] = set()

    def __call__(self, frame: FrameType, event: str, arg: object) -> None:
        if self.active and event == "call":
            name = frame.f_globals.get("__name__", "")
            if name == "router" or name.startswith("router."):
                self.modules.add(name)

    @contextmanager
    def installed(self) -> Iterator[None]:
        before: Callable[..., Any] | None = sys.getprofile()
        threads_before = threading.getprofile()
        sys.setprofile(self)
        threading.setprofile(self)
        try:
            yield
        finally:
            threading.setprofile(threads_before)
            sys.setprofile(before)

    def one(self, send: Callable[[], None]) -> set[str]:
        self.modules = set()
        self.active = True
        try:
            send()
        finally:
            self.active = False
        return self.modules


@pytest.fixture(scope="module")
def measured(tmp_path_factory: pytest.TempPathFactory) -> dict[str, set[str]]:
    """Each request's modules: the app and its runtime started, each request sent WARM_UP times,
    then three more times under the recorder."""
    runtime = make_runtime(tmp_path_factory.mktemp("fleet"), FLEET)
    recorder = Recorder()
    found: dict[str, set[str]] = {}
    with recorder.installed(), TestClient(app=create_app(runtime)) as client:
        deadline = time.monotonic() + 30
        while not runtime.ready:
            assert time.monotonic() < deadline, "models did not load"
            time.sleep(0.05)
        for label, (path, body) in REQUESTS.items():
            def send(path: str = path, body: dict[str, Any] = body) -> None:
                answer = client.post(path, json=body)
                assert answer.status_code == 200, f"{path}: {answer.status_code} {answer.text}"
            for _ in range(WARM_UP):
                send()
            # The modules of every one of three requests: a background task (a scheduler's tick, the
            # memory trimmer) that happens to run during one of them does not count as the path.
            found[label] = set.intersection(*(recorder.one(send) for _ in range(3)))
    return found


def test_a_native_predict_meets_the_modules_the_map_lists(measured: dict[str, set[str]]) -> None:
    listed, rows = the_map()
    assert len(listed) == len(set(listed)), f"the map lists a module twice: {listed}"
    touched = measured["native predict"]
    print(f"\na native predict in one process meets {len(touched)} modules of router/")
    assert (sorted(touched - set(listed)), sorted(set(listed) - touched)) == ([], []), (
        "(met but not in the map, in the map but not met): update docs/architecture.md, "
        f"{HEADING!r}, with the path as it is now; met: {sorted(touched)}")
    assert rows["native predict"][0] == str(len(touched)), "the map's table counts the predict otherwise"


@pytest.mark.parametrize("label", [label for label in REQUESTS if label != "native predict"])
def test_the_other_requests_meet_what_the_map_table_says(measured: dict[str, set[str]], label: str) -> None:
    listed, rows = the_map()
    assert label in rows, f"the map's table has no row {label!r}"
    count, more, less = rows[label]
    touched = measured[label]
    print(f"\n{label}: {len(touched)} modules of router/")
    expected = (set(listed) | more) - less
    assert (sorted(touched - expected), sorted(expected - touched)) == ([], []), (
        f"(met but not in the map, in the map but not met) for {label!r}; met: {sorted(touched)}")
    assert count == str(len(touched)), f"the map's table counts {label!r} as {count}"
