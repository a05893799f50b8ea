"""The throughput part of the GPU check (written, not yet run on a GPU).

ResNet-50 and YOLOv8n through the router, from JPEG bytes over HTTP to the answer, on a real photo
(ultralytics' bus.jpg, 810x1080). Each model as it ships (eager PyTorch, the JPEG decoded on the
host), with nvJPEG decode on the device (gpu_decode), and through ONNX Runtime's CUDA provider where
the installed onnxruntime offers it. Closed loop from several load generator processes; ResNet-50's
figures beside Triton's published 6,127 img/s on an A100 (a reference, not measured side by side).
Writes OUT/throughput.md.

    python -m gpu_check.throughput OUT [--store DIR] [--seconds 6] [--device cuda:0]

Without CUDA it writes its rows as skipped; `--device cpu` runs the same code on the CPU (resnet18,
short runs: how the code is exercised where there is no GPU).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.systems import serve_router
from benchmarks.workloads import REPO
from gpu_check.loads import body_target, drive, photo, run_part

__all__ = ["TRITON_RESNET50_A100", "Variant", "fleet_yaml", "throughput_rows", "variants"]

TRITON_RESNET50_A100 = 6127.0  # img/s, Triton's published figure for ResNet-50 on an A100 (a reference, not measured side by side)


@dataclass(frozen=True)
class Variant:
    name: str  # the fleet's model name
    label: str  # the results row
    plugin: str
    options: dict[str, Any]
    max_batch: int
    resnet: bool = False  # compared with Triton's ResNet-50 figure


def variants(device: str, arch: str, onnx: bool) -> list[Variant]:
    """What is measured: each model eager, eager with nvJPEG decode (on CUDA), and on ONNX Runtime."""
    resnet = {"arch": arch, "weights": f"{arch}.pt"}
    yolo = {"model": "yolov8n.pt", "imgsz": 640}
    found = [Variant("resnet-eager", f"{arch} eager, host decode", "resnet", resnet, 64, resnet=True),
             Variant("yolo-eager", "yolov8n eager, host decode", "yolo", yolo, 32)]
    if device.startswith("cuda"):
        found += [Variant("resnet-nvjpeg", f"{arch} eager, nvJPEG decode", "resnet", {**resnet, "gpu_decode": True}, 64,
                          resnet=True),
                  Variant("resnet-nvjpeg-fp16", f"{arch} eager fp16, nvJPEG decode", "resnet",
                          {**resnet, "gpu_decode": True, "half": True}, 64, resnet=True),
                  Variant("yolo-nvjpeg", "yolov8n eager, nvJPEG decode", "yolo", {**yolo, "gpu_decode": True}, 32)]
    if onnx:
        found += [Variant("resnet-onnx", f"{arch} ONNX Runtime, host decode", "onnx", {"model": f"{arch}.onnx"}, 64,
                          resnet=True),
                  Variant("yolo-onnx", "yolov8n ONNX Runtime, host decode", "onnx", {"model": "yolov8n.onnx"}, 32)]
    return found


def fleet_yaml(store: Path, device: str, chosen: list[Variant]) -> str:
    """One router serving every variant on the device; queues deep enough for every client at once."""
    probe = "probe: nvml" if device.startswith("cuda") else "probe: host, high_watermark: 1.0, low_watermark: 1.0"
    lines = [f"model_store: {store}", "devices:", f"  {device}: {{{probe}}}", "models:"]
    for v in chosen:
        memory = ", memory: {profile: false}" if v.plugin == "onnx" else ""
        lines.append(f"  {v.name}: {{plugin: {v.plugin}, device: {device}, options: {json.dumps(v.options)}, "
                     f"batch: {{max_size: {v.max_batch}, max_delay_ms: 5}}, queue: {{max_size: 1024, timeout_ms: 30000}}"
                     f"{memory}}}")
    return "\n".join(lines) + "\n"


def export_onnx(store: Path, device: str, arch: str, out: Path) -> str | None:
    """ONNX files of both models (`model-router export --format onnx`); None, or why not."""
    config = out / "export-fleet.yaml"
    config.write_text(f"model_store: {store}\nmodels:\n  {arch}: {{plugin: resnet, options: {{arch: {arch}, weights: "
                      f"{arch}.pt}}}}\n  yolov8n: {{plugin: yolo, options: {{model: yolov8n.pt, imgsz: 640}}}}\n")
    for model in (arch, "yolov8n"):
        command = [sys.executable, "-m", "router", "export", "--config", str(config), "--model", model, "--format", "onnx"]
        done = subprocess.run(command + (["--device", device] if device.startswith("cuda") else []), cwd=REPO,
                              capture_output=True, text=True, timeout=300, check=False)
        (out / f"export-{model}.log").write_text(done.stdout + done.stderr, encoding="utf-8")
        if done.returncode != 0:
            return f"the ONNX export of {model} failed: {done.stderr.strip()[-200:]}"
    return None


def onnx_reason(device: str) -> str | None:
    """None where ONNX Runtime can run on `device`, else why its rows skip."""
    import onnxruntime

    providers = onnxruntime.get_available_providers()
    if device.startswith("cuda") and "CUDAExecutionProvider" not in providers:
        return (f"onnxruntime {onnxruntime.__version__} here offers only {', '.join(providers)}; the CUDA provider "
                "needs onnxruntime-gpu, a 244 MiB wheel the wheelhouse cannot carry")
    return None


def throughput_rows(label: str, report: dict[str, Any], resnet: bool, clients: str) -> tuple[str, str, str]:
    """One variant's row: images per second, latency, statuses; ResNet's beside Triton's figure."""
    statuses = report["statuses"]
    ok = statuses.get("200", 0)
    bad = {s: n for s, n in statuses.items() if s != "200"}
    detail = (f"{report['throughput_rps']:.0f} img/s, p50 {report['ok_ms'].get('p50')} ms, "
              f"p99 {report['ok_ms'].get('p99')} ms over {ok} answers ({clients})")
    if resnet:
        detail += f"; {report['throughput_rps'] / TRITON_RESNET50_A100:.2f}x Triton's 6,127 img/s (A100, published)"
    if bad or report["errors"]:
        return label, "FAIL", f"{detail}; not 200: {bad} {report['errors']}"
    return label, "info", detail


def measure(store: Path, out: Path, device: str, arch: str, seconds: float, processes: int, concurrency: int,
            onnx: bool = True) -> list[tuple[str, str, str]]:
    rows: list[tuple[str, str, str]] = []
    reason = onnx_reason(device) if onnx else "not asked for (--no-onnx)"
    if reason is None:
        reason = export_onnx(store, device, arch, out)
    chosen = variants(device, arch, onnx=reason is None)
    if reason is not None:
        rows += [(f"{arch} / yolov8n ONNX Runtime", "skipped", reason)]
    image = photo()
    clients = f"{processes} clients x {concurrency} connections, {image.name}"
    with serve_router(fleet_yaml(store, device, chosen), out, timeout_s=240) as server:
        for variant in chosen:
            target = body_target(f"/models/{variant.name}/predict", image)
            drive(server.url, [target], min(1.5, seconds), processes, concurrency=concurrency)  # warm-up
            report = drive(server.url, [target], seconds, processes, concurrency=concurrency)
            (out / f"{variant.name}.json").write_text(json.dumps(report, indent=2), encoding="utf-8")
            rows.append(throughput_rows(variant.label, report, variant.resnet, clients))
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--store", type=Path, help="default: OUT/store")
    parser.add_argument("--device", default="cuda:0")
    parser.add_argument("--seconds", type=float, default=6.0)
    parser.add_argument("--processes", type=int, default=4)
    parser.add_argument("--concurrency", type=int, default=48)
    parser.add_argument("--no-onnx", action="store_true", help="leave out the ONNX Runtime runs (and their export)")
    args = parser.parse_args(argv)
    out = args.out.resolve()
    checks = [v.label for v in variants("cuda:0", "resnet50", onnx=True)]
    return run_part("throughput", out, args.device, args.store, checks, lambda store, arch: measure(
        store, out, args.device, arch, args.seconds, args.processes, args.concurrency, not args.no_onnx))


if __name__ == "__main__":
    raise SystemExit(main())
