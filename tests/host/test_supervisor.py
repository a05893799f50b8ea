"""The parent's decisions: how many fronts, how long before a restart, what each child's environment holds."""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import pytest

from router.config import ServerSettings, resolve_workers
from router.host.supervisor import FIRST_RESTART_S, FRONT_THREADS, MAX_RESTART_S, Child, Supervisor, restart_delay


def test_auto_is_one_process_on_two_cores_and_a_front_per_core_above() -> None:
    assert [resolve_workers("auto", cores) for cores in (1, 2, 3, 8, 64)] == [1, 1, 3, 8, 16]
    assert resolve_workers(4, 2) == 4


def test_a_child_that_keeps_dying_waits_longer_each_time_up_to_a_bound() -> None:
    delays = [restart_delay(deaths) for deaths in range(1, 10)]
    assert delays[0] == FIRST_RESTART_S and delays == sorted(delays) and delays[-1] == MAX_RESTART_S


def test_a_front_runs_its_hooks_native_libraries_on_one_thread_and_the_engine_on_the_settings(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each front gets FRONT_THREADS over the parent's environment (torch, OpenBLAS and MKL read it
    as they load); the engine gets the parent's own, whatever the operator set there."""
    monkeypatch.setenv("OMP_NUM_THREADS", "6")
    supervisor = Supervisor(ServerSettings(), workers=2)
    # The child writes its environment to the file its first argument names (the engine's command
    # gets --epoch and --board-fd after it).
    report = "import json, os, sys; open(sys.argv[1], 'w').write(json.dumps({k: os.environ.get(k) for k in %r}))"
    seen = {}
    try:
        for role in ("engine", "front 1"):
            out = tmp_path / f"{role}.json"
            child = Child(role, [sys.executable, "-c", report % list(FRONT_THREADS), str(out)])
            supervisor._start(child, supervisor._environment())
            assert child.process is not None and child.process.wait(30) == 0
            seen[role] = json.loads(out.read_text())
    finally:
        shutil.rmtree(supervisor.run_dir, ignore_errors=True)
    assert seen["front 1"] == dict.fromkeys(FRONT_THREADS, "1")
    assert seen["engine"] == {k: os.environ.get(k) for k in FRONT_THREADS} and seen["engine"]["OMP_NUM_THREADS"] == "6"
