"""The GPU check's parts, one after another, each under its own time limit and all within one budget
(8 minutes), none stopping the others; then OUT/results.md (one row per check), OUT/device.txt (what
the machine is) and OUT/logs.tar.gz (every part's log and table). Started by scripts/gpu-check.sh;
needs nothing beyond the standard library itself, so it runs even where the set-up failed.

    python -m gpu_check.run OUT [--work DIR] [--wheelhouse DIR] [--budget-s 480]
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from gpu_check.results import Row, junit_rows, parse_table, render, summary

__all__ = ["GPU_TEST_FILES", "PARTS", "Part", "outcome_rows", "time_for"]

REPO = Path(__file__).resolve().parents[1]
BUDGET_S = 480
MIN_PART_S = 20  # a part given less would only time out
STOP_GRACE_S = 20  # from SIGTERM (servers stopped by the part's own clean-up) to SIGKILL
LOG_LIMIT = 2 * 2**20  # files larger than this stay out of logs.tar.gz
# legacy: the JUnit family that keeps record_property's figures without a warning.
# Every test file with `gpu`-marked tests (tests/test_gpu_check.py checks the list is complete).
GPU_TEST_FILES = ("tests/test_gpu.py", "tests/test_probes.py", "tests/plugins/test_device_decode.py",
                  "tests/plugins/test_onnx.py", "tests/plugins/test_resnet.py", "tests/plugins/test_tensorrt.py",
                  "tests/plugins/test_yolo.py", "tests/e2e/test_example_tiny_cnn.py")
# What every part runs with: ultralytics neither looks for a network nor installs anything.
ENVIRONMENT = {"PYTHONUNBUFFERED": "1", "YOLO_OFFLINE": "1", "YOLO_AUTOINSTALL": "false"}


@dataclass(frozen=True)
class Part:
    name: str
    args: tuple[str, ...]  # after the Python executable; {work} and {wheelhouse} are filled in
    limit_s: float
    table: str  # its rows, under the work folder: a markdown table, or a JUnit report (.xml)


PARTS = (
    Part("environment", ("-m", "gpu_check.environment", "{work}", "--wheelhouse", "{wheelhouse}"), 90,
         "environment.md"),
    Part("gpu tests", ("-m", "pytest", "-m", "gpu", "-p", "no:cacheprovider", "-q", "-rA", "-o", "junit_family=legacy",
                       "--junitxml={work}/gpu-tests.xml", *GPU_TEST_FILES), 150, "gpu-tests.xml"),
    Part("surge", ("-m", "gpu_check.surge", "{work}/surge", "--store", "{work}/store"), 90, "surge/surge.md"),
    Part("throughput", ("-m", "gpu_check.throughput", "{work}/throughput", "--store", "{work}/store"), 150,
         "throughput/throughput.md"),
    Part("engines", ("scripts/gpu_engine_check.py", "{work}/engines", "--device", "auto", "--skip-without-cuda"), 120,
         "engines/engines.md"),
    Part("cluster", ("scripts/gpu_cluster_check.py", "{work}/cluster"), 90, "cluster/cluster.md"),
)


def time_for(part: Part, left_s: float) -> float | None:
    """The part's limit within what is left of the budget; None when too little is left to start it."""
    limit = min(part.limit_s, left_s)
    return limit if limit >= MIN_PART_S else None


def outcome_rows(part: Part, returncode: int | None, limit_s: float, table: str | None, log: str) -> list[Row]:
    """The part's rows, and a FAIL row where it timed out (returncode None), wrote nothing or exited
    with an error that none of its rows shows."""
    if table is None:
        rows = []
    elif part.table.endswith(".xml"):
        rows = junit_rows(table, part.name)
    else:
        rows = parse_table(table, part.name)
    if returncode is None:
        return [*rows, Row(part.name, "time limit", "FAIL", f"stopped after {limit_s:.0f} s; see {log}")]
    if not rows:
        return [Row(part.name, "results", "FAIL", f"wrote none (exit status {returncode}); see {log}")]
    if returncode != 0 and not any(row.result == "FAIL" for row in rows):
        rows.append(Row(part.name, "exit status", "FAIL", f"{returncode}; see {log}"))
    return rows


def _descendants(pid: int) -> list[int]:
    try:
        import psutil
    except ImportError:
        return []
    try:
        return [child.pid for child in psutil.Process(pid).children(recursive=True)]
    except psutil.Error:
        return []


def _stop(process: subprocess.Popen[bytes]) -> None:
    """SIGTERM (the parts stop their servers on it), then SIGKILL to whatever of its tree is left."""
    family = _descendants(process.pid)
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(STOP_GRACE_S)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(5)
    for pid in family:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def part_command(part: Part, python: str, work: Path, wheelhouse: Path | None) -> list[str]:
    """The part's command line; without a wheelhouse, its --wheelhouse option is left out."""
    args = list(part.args)
    if wheelhouse is None and "--wheelhouse" in args:
        at = args.index("--wheelhouse")
        del args[at:at + 2]
    fill = {"work": str(work), "wheelhouse": str(wheelhouse)}
    return [python, *(arg.format(**fill) for arg in args)]


def run_part(part: Part, python: str, work: Path, wheelhouse: Path | None, limit_s: float) -> list[Row]:
    """Run one part with its output in work/logs/; its rows."""
    command = part_command(part, python, work, wheelhouse)
    log = work / "logs" / (part.name.replace(" ", "-") + ".log")
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "wb") as out:
        process = subprocess.Popen(command, cwd=REPO, stdout=out, stderr=subprocess.STDOUT,
                                   env={**os.environ, **ENVIRONMENT})
        try:
            returncode: int | None = process.wait(limit_s)
        except subprocess.TimeoutExpired:
            _stop(process)
            returncode = None
    table = work / part.table
    text = table.read_text(encoding="utf-8", errors="replace") if table.is_file() else None
    return outcome_rows(part, returncode, limit_s, text, f"logs/{log.name}")


def run_all(parts: Sequence[Part], python: str, work: Path, wheelhouse: Path | None, budget_s: float) -> list[Row]:
    rows: list[Row] = []
    deadline = time.monotonic() + budget_s
    for part in parts:
        limit = time_for(part, deadline - time.monotonic())
        if limit is None:
            rows.append(Row(part.name, "not started", "FAIL", f"no time left of the {budget_s:.0f} s budget"))
            continue
        started = time.monotonic()
        print(f"gpu-check: {part.name} (at most {limit:.0f} s) ...", flush=True)
        found = run_part(part, python, work, wheelhouse, limit)
        print(f"gpu-check: {part.name}: {summary(found)} in {time.monotonic() - started:.0f} s", flush=True)
        rows += found
    return rows


def pack_logs(work: Path, archive: Path) -> None:
    """Every small log, table and report of the work folder (not the venv, the models or the images)."""
    with tarfile.open(archive, "w:gz") as tar:
        for path in sorted(work.rglob("*")):
            inside = path.relative_to(work)
            if path.is_file() and inside.parts[0] != "venv" and path.suffix in {".log", ".md", ".json", ".xml",
                                                                                ".yaml", ".txt"} \
                    and path.stat().st_size <= LOG_LIMIT:
                tar.add(path, arcname=str(inside))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--work", type=Path)
    parser.add_argument("--wheelhouse", type=Path, help="the wheelhouse installed first, if any")
    parser.add_argument("--budget-s", type=float, default=BUDGET_S)
    args = parser.parse_args(argv)
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    work = (args.work or Path(tempfile.mkdtemp(prefix="gpu-check-"))).resolve()
    started = time.monotonic()
    setup = work / "setup.md"  # the wheelhouse's install, by scripts/gpu-check.sh
    rows = parse_table(setup.read_text(encoding="utf-8"), "set-up") if setup.is_file() else []
    wheelhouse = args.wheelhouse.resolve() if args.wheelhouse else None
    rows += run_all(PARTS, sys.executable, work, wheelhouse, args.budget_s)
    environment_log = work / "logs" / "environment.log"
    if environment_log.is_file():
        description = environment_log.read_text(encoding="utf-8", errors="replace")
        (out / "device.txt").write_text(description, encoding="utf-8")
        print(description, end="")
    table = render(rows) + f"\n{summary(rows)}; {time.monotonic() - started:.0f} s in all\n"
    (out / "results.md").write_text(table, encoding="utf-8")
    pack_logs(work, out / "logs.tar.gz")
    print(table, end="")
    return 1 if any(row.result == "FAIL" for row in rows) else 0


if __name__ == "__main__":
    raise SystemExit(main())
