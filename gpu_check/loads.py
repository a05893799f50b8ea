"""What the surge and throughput parts share: their model store, load generator processes and their
merged reports, /metrics readings, a part's table, and a clean stop on SIGTERM (the run's time limit)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, NoReturn

from benchmarks.workloads import REPO, ultralytics_asset
from gpu_check.results import part_table as table

__all__ = ["GIB", "NO_CUDA", "PHOTO", "body_target", "cuda_available", "drive", "gib", "merge", "metric", "photo",
           "prepare_store", "run_part", "skipped", "stop_on_sigterm", "table"]

PHOTO = "bus.jpg"  # ultralytics' 810x1080 street photo: a real JPEG to decode
RESNET_SEED = 0


def photo() -> Path:
    return Path(ultralytics_asset(PHOTO))


def stop_on_sigterm() -> None:
    """SIGTERM raises SystemExit, so the servers' context managers stop them before the part ends."""

    def leave(signum: int, frame: object) -> NoReturn:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, leave)


def cuda_available() -> bool:
    import torch

    return bool(torch.cuda.is_available())


def prepare_store(store: Path, archs: Iterable[str] = ("resnet50",)) -> Path:
    """The demo store (yolov8n.pt, resnet18.pt) and untrained, calibrated `archs` state dicts
    (resnet50.pt): random weights, since throughput does not depend on their values."""
    from router.sdk import calibrate_batchnorm
    from router.store import init_demo

    store.mkdir(parents=True, exist_ok=True)
    init_demo(store, progress=lambda line: None)
    for arch in archs:
        path = store / f"{arch}.pt"
        if not path.is_file():
            import torch
            import torchvision

            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(RESNET_SEED)
                network = getattr(torchvision.models, arch)(weights=None)
            calibrate_batchnorm(network, RESNET_SEED, side=224)
            torch.save(network.state_dict(), path)
    return store


def merge(reports: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Load generator reports of processes that ran side by side: counts and rates summed, latency
    percentiles the worst of the processes."""
    merged: dict[str, Any] = {"processes": len(reports), "requests": 0, "throughput_rps": 0.0,
                              "statuses": Counter(), "errors": Counter(), "rejected_without_retry_after": 0, "ok_ms": {}}
    for report in reports:
        for key in ("requests", "throughput_rps", "rejected_without_retry_after"):
            merged[key] += report.get(key) or 0
        merged["statuses"].update(report.get("statuses", {}))
        merged["errors"].update(report.get("errors", {}))
        for q, value in (report.get("ok_ms") or {}).items():
            if value is not None:
                merged["ok_ms"][q] = max(value, merged["ok_ms"].get(q) or 0.0)
    merged["throughput_rps"] = round(merged["throughput_rps"], 1)
    merged["statuses"], merged["errors"] = dict(merged["statuses"]), dict(merged["errors"])
    return merged


def drive(url: str, targets: Sequence[str], seconds: float, processes: int, *, concurrency: int | None = None,
          rates: Sequence[float] | None = None, timeout_s: float = 30.0) -> dict[str, Any]:
    """`processes` load generators at once (closed loop at `concurrency` each, or open loop at
    `rates` per target, split between them); their merged report, and each target's."""
    base = [sys.executable, "-m", "benchmarks.loadgen", "--url", url, "--duration", str(seconds),
            "--timeout", str(timeout_s), "--per-target", *(f"--target={t}" for t in targets)]
    if concurrency is not None:
        mode = ["--concurrency", str(concurrency)]  # worker i to target i mod n: each model its own workers
    elif rates is not None:
        mode = ["--rates", ",".join(f"{rate / processes:.3f}" for rate in rates)]
    else:
        raise ValueError("drive needs concurrency (closed loop) or rates (open loop)")
    running = [subprocess.Popen([*base, *mode], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
               for _ in range(processes)]
    reports = []
    for process in running:
        out, err = process.communicate(timeout=seconds + timeout_s + 60)
        if process.returncode != 0:
            raise RuntimeError(f"the load generator failed: {err[-500:]}")
        reports.append(json.loads(out))
    merged = merge(reports)
    paths = [target.split("=", 1)[0] for target in targets]
    merged["targets"] = {path: merge([r["targets"][path] for r in reports]) for path in paths}
    return merged


def metric(text: str, name: str, device: str) -> float:
    """A device's gauge in a /metrics exposition (0 when absent)."""
    prefix = f'{name}{{device="{device}"}} '
    values = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(prefix)]
    return values[0] if values else 0.0


Rows = list[tuple[str, str, str]]


def run_part(name: str, out: Path, device: str, store: Path | None, checks: Iterable[str],
             measure: Callable[[Path, str], Rows]) -> int:
    """A GPU part's frame: without CUDA (and not asked to run on the CPU) its checks skipped; else
    the store prepared, `measure(store, arch)` run, a failure of it one FAIL row, and a row with the
    part's time. Writes OUT/NAME.md; the exit status."""
    out.mkdir(parents=True, exist_ok=True)
    stop_on_sigterm()
    on_cpu = device == "cpu"
    if not on_cpu and not cuda_available():
        (out / f"{name}.md").write_text(skipped(checks, NO_CUDA), encoding="utf-8")
        return 0
    arch = "resnet18" if on_cpu else "resnet50"
    started = time.monotonic()
    try:
        rows = measure(prepare_store((store or out / "store").resolve(), archs=(arch,)), arch)
    except RuntimeError as exc:
        rows = [(f"{name} runs", "FAIL", str(exc)[-300:])]
    rows.append((f"{name} part", "info", f"{time.monotonic() - started:.0f} s in all"))
    (out / f"{name}.md").write_text(table(rows), encoding="utf-8")
    return 1 if any(result == "FAIL" for _, result, _ in rows) else 0


def body_target(path: str, body: Path, content_type: str = "image/jpeg") -> str:
    """A load generator target sending a file's bytes."""
    return f"{path}={content_type}:@{body}"


def skipped(checks: Iterable[str], reason: str) -> str:
    return table((check, "skipped", reason) for check in checks)


NO_CUDA = "no CUDA: torch.cuda.is_available() is False"
GIB = 2**30


def gib(value: float) -> str:
    return f"{value / GIB:.2f} GiB"
