"""The GPU check rehearsed here (gpu_check.rehearsal): the wheelhouse built and sized, installed
with --no-index into a bare environment holding only the target image's packages, and
scripts/gpu-check.sh run there to its results table, every GPU row skipped for want of CUDA; and
the surge and throughput parts run on the CPU, the code they run on a GPU exercised end to end."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from gpu_check.rehearsal import results_rows
from gpu_check.results import parse_table

pytestmark = [pytest.mark.e2e]

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One store for both CPU runs: the demo checkpoints, built once."""
    from gpu_check.loads import prepare_store

    return prepare_store(tmp_path_factory.mktemp("store"), archs=("resnet18",))


def run_module(*args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", *args], cwd=REPO, capture_output=True, text=True, timeout=timeout,
                          check=False)


@pytest.mark.timeout(900)
def test_the_rehearsal_reaches_the_results_table_with_every_gpu_row_skipped(tmp_path: Path) -> None:
    done = run_module("gpu_check.rehearsal", "--work", str(tmp_path), "--wheelhouse", str(REPO / ".whl"), timeout=840)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert "wheelhouse for CPython 3.12 (manylinux x86-64): " in done.stdout and "(limit 60 MiB)" in done.stdout
    rows = results_rows((tmp_path / "out" / "results.md").read_text())
    by_part = {part: [r for r in rows if r.part == part] for part in {r.part for r in rows}}
    assert [r.result for r in by_part["set-up"]] == ["pass"]
    assert {r.check: r.result for r in by_part["environment"]}["imports"] == "pass"
    gpu_rows = [r for r in rows if r.part not in ("set-up", "environment")]
    assert len(gpu_rows) >= 20 and all(r.result == "skipped" and "CUDA" in r.detail for r in gpu_rows)
    assert {"gpu tests", "surge", "throughput", "engines", "cluster"} <= set(by_part)
    assert (tmp_path / "out" / "logs.tar.gz").stat().st_size > 0 and (tmp_path / "out" / "device.txt").is_file()


@pytest.mark.timeout(300)
def test_the_surge_part_runs_on_the_cpu(tmp_path: Path, store: Path) -> None:
    done = run_module("gpu_check.surge", str(tmp_path), "--store", str(store), "--device", "cpu", "--seconds", "4", "--processes", "1",
                      "--concurrency", "4", timeout=280)
    rows = {r.check: r for r in parse_table((tmp_path / "surge.md").read_text(), "surge")}
    assert done.returncode == 0, (tmp_path / "surge.md").read_text() + done.stderr[-2000:]
    assert rows["5x surge, open loop: answered or shed"].result == "pass"
    assert rows["no CUDA out-of-memory"].result == "pass"
    assert "rps" in rows["capacity, closed loop"].detail and "ledger peak" in rows["ledger vs NVML under load"].detail


@pytest.mark.timeout(300)
def test_the_throughput_part_runs_on_the_cpu(tmp_path: Path, store: Path) -> None:
    done = run_module("gpu_check.throughput", str(tmp_path), "--store", str(store), "--device", "cpu", "--seconds", "2", "--processes", "1",
                      "--concurrency", "4", "--no-onnx", timeout=280)
    text = (tmp_path / "throughput.md").read_text()
    assert done.returncode == 0, text + done.stderr[-2000:]
    rows = {r.check: r for r in parse_table(text, "throughput")}
    assert rows["resnet18 eager, host decode"].result == "info" and "img/s" in rows["resnet18 eager, host decode"].detail
    assert "Triton's 6,127 img/s" in rows["resnet18 eager, host decode"].detail
    assert rows["yolov8n eager, host decode"].result == "info"
    assert rows["resnet18 / yolov8n ONNX Runtime"].result == "skipped"
