"""Engine checks for scripts/gpu-check.sh: export both demo models (ONNX, and TensorRT where it and
a GPU are present), serve every engine beside its eager original through a real router, compare
their answers at batch 1 and 8, and compare the scheduler's ledger with the device's own memory
readings (NVML). Writes OUT/engines.md, one row per check.

    python scripts/gpu_engine_check.py OUT [--device cuda:0]

It runs on a CPU too (TensorRT and NVML rows then say why they were skipped); that is how it is
exercised on machines without a GPU.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from router.sdk.images import example_jpeg
from router.sdk.plugin import Payload

REPO = Path(__file__).resolve().parents[1]

BOX_PX = {"fp32": 1.0, "fp16": 2.0}
SCORE = {"fp32": 1e-3, "fp16": 2e-2}
LOAD_REQUESTS = {"gpu": 48, "cpu": 8}  # per model, all at once, while the ledger and the probe are sampled


@dataclass(frozen=True)
class Row:
    check: str
    result: str  # pass, FAIL, warn, skipped, info
    detail: str


# -- export ------------------------------------------------------------------------------------------


def export_models(store: Path, out: Path) -> tuple[list[Row], dict[str, str]]:
    """`model-router export --format auto` for both models (ResNet's engine in fp16); returns rows
    and the precision of each engine built."""
    config = out / "source-fleet.yaml"
    config.write_text(
        f"model_store: {store}\nmodels:\n"
        "  yolov8n: {plugin: yolo, options: {model: yolov8n.pt, imgsz: 640}, batch: {max_size: 8}}\n"
        "  resnet18: {plugin: resnet, options: {weights: resnet18.pt}, batch: {max_size: 8}}\n",
        encoding="utf-8",
    )
    rows, engines = [], {}
    for model, fp16 in (("yolov8n", False), ("resnet18", True)):
        command = [sys.executable, "-m", "router", "export", "--config", str(config), "--model", model]
        started = time.perf_counter()
        result = subprocess.run([*command, *(["--fp16"] if fp16 else [])], check=False, cwd=REPO, capture_output=True,
                                text=True, timeout=420)
        (out / f"export-{model}.log").write_text(result.stderr, encoding="utf-8")
        seconds = f"{time.perf_counter() - started:.0f} s"
        # "onnxruntime vs PyTorch at batch N: ..." and "tensorrt vs onnxruntime at batch N: ..."
        checks = [line.strip() for line in result.stderr.splitlines() if " vs " in line and " at batch " in line]
        onnx_ok = result.returncode == 0 and (store / f"{model}.onnx").is_file()
        rows.append(Row(f"export {model} -> ONNX", "pass" if onnx_ok else "FAIL",
                        "; ".join(c for c in checks if c.startswith("onnxruntime")) or result.stderr[-300:]))
        skipped = [line for line in result.stderr.splitlines() if line.startswith("skipped the TensorRT engine")]
        if skipped:
            rows.append(Row(f"export {model} -> TensorRT", "skipped", skipped[0].split(": ", 1)[-1]))
        elif (store / f"{model}.engine").is_file():
            engines[model] = "fp16" if fp16 else "fp32"
            detail = "; ".join(c for c in checks if c.startswith("tensorrt"))
            rows.append(Row(f"export {model} -> TensorRT {engines[model]}", "pass", f"{detail} ({seconds})"))
        else:
            rows.append(Row(f"export {model} -> TensorRT", "FAIL", result.stderr[-300:]))
    return rows, engines


# -- serving -----------------------------------------------------------------------------------------


def onnx_device(device: str) -> str:
    """Where the onnx models run: the device when onnxruntime can use it, else the CPU."""
    if device == "cpu":
        return "cpu"
    import onnxruntime

    return device if "CUDAExecutionProvider" in onnxruntime.get_available_providers() else "cpu"


def serving_fleet(store: Path, device: str, engines: dict[str, str]) -> tuple[str, list[tuple[str, str, str, str]]]:
    """The fleet YAML, and the (eager, engine, task, precision) pairs to compare."""
    ort_device = onnx_device(device)
    # On a CPU the host probe stands in for NVML, with watermarks that never pause admission.
    settings = "probe: nvml" if device.startswith("cuda") else "probe: host, high_watermark: 1.0, low_watermark: 1.0"
    lines = [f"model_store: {store}", "devices:", f"  {device}: {{{settings}}}"]
    if ort_device != device:
        lines.append("  cpu: {probe: none, memory_budget: 16GB}")
    lines.append("models:")
    batch = "batch: {max_size: 8, max_delay_ms: 1500}, queue: {max_size: 256, timeout_ms: 60000}"
    # torch's allocator cannot see onnxruntime's or TensorRT's memory: keep their own estimates.
    no_profile = "memory: {profile: false}"
    models = [
        ("yolo-eager", f"plugin: yolo, device: {device}, options: {{model: yolov8n.pt, imgsz: 640}}"),
        ("resnet-eager", f"plugin: resnet, device: {device}, options: {{weights: resnet18.pt}}"),
        ("yolo-onnx", f"plugin: onnx, device: {ort_device}, options: {{model: yolov8n.onnx}}, {no_profile}"),
        ("resnet-onnx", f"plugin: onnx, device: {ort_device}, options: {{model: resnet18.onnx}}, {no_profile}"),
    ]
    pairs = [("yolo-eager", "yolo-onnx", "detect", "fp32"), ("resnet-eager", "resnet-onnx", "classify", "fp32")]
    for source, short, task in (("yolov8n", "yolo", "detect"), ("resnet18", "resnet", "classify")):
        if source in engines:
            models.append((f"{short}-trt", f"plugin: tensorrt, device: {device}, options: {{engine: {source}.engine}}"))
            pairs.append((f"{short}-eager", f"{short}-trt", task, engines[source]))
    lines += [f"  {name}: {{{spec}, {batch}}}" for name, spec in models]
    return "\n".join(lines) + "\n", pairs


@contextmanager
def router(fleet: str, out: Path, timeout_s: float = 300) -> Iterator[str]:
    """`model-router serve` on a free loopback port until ready; stopped on exit."""
    config = out / "serving-fleet.yaml"
    config.write_text(fleet, encoding="utf-8")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {**os.environ, "MODEL_ROUTER_HOST": "127.0.0.1", "MODEL_ROUTER_PORT": str(port),
           "MODEL_ROUTER_CONFIG": str(config)}
    with open(out / "serve.log", "wb") as log:
        process = subprocess.Popen([sys.executable, "-m", "router", "serve"], cwd=REPO, env=env, stdout=log,
                                   stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_ready(url, process, timeout_s)
        yield url
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()


def _wait_ready(url: str, process: subprocess.Popen[bytes], timeout_s: float) -> None:
    """Until /health/ready says yes; a model that failed to load ends the wait at once."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the router exited with {process.returncode}; see serve.log")
        try:
            if httpx.get(url + "/health/ready", timeout=2).status_code == 200:
                return
            failed = [m for m in httpx.get(url + "/models", timeout=2).json()["models"] if m["state"] == "failed"]
        except httpx.HTTPError:
            failed = []
        if failed:
            raise RuntimeError("; ".join(f"{m['name']} failed to load: {m['error']}" for m in failed))
        time.sleep(0.2)
    raise RuntimeError(f"the router was not ready after {timeout_s:.0f} s; see serve.log")


def images() -> list[Payload]:
    files = [Payload((REPO / "examples" / n).read_bytes(), m) for n, m in (("street.jpg", "image/jpeg"),
                                                                          ("square.png", "image/png"))]
    sizes = [(320, 240), (200, 360), (500, 300), (96, 96), (640, 360), (256, 256)]
    return files + [example_jpeg(w, h, seed=i) for i, (w, h) in enumerate(sizes)]


async def _predict(url: str, model: str, payloads: list[Payload]) -> list[dict[str, Any]]:
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        responses = await asyncio.gather(*(client.post(f"/models/{model}/predict", content=p.body,
                                                       headers={"content-type": p.media_type}) for p in payloads))
    bad = [r for r in responses if r.status_code != 200]
    if bad:
        raise RuntimeError(f"{model}: {bad[0].status_code} {bad[0].text[:200]}")
    return [r.json() for r in responses]


# -- answers side by side ------------------------------------------------------------------------------


def compare_pairs(url: str, pairs: list[tuple[str, str, str, str]]) -> list[Row]:
    payloads, rows = images(), []
    for eager, engine, task, precision in pairs:
        for size in (1, 8):
            batch = payloads[:size]
            try:
                want = asyncio.run(_predict(url, eager, batch))
                got = asyncio.run(_predict(url, engine, batch))
            except RuntimeError as exc:
                rows.append(Row(f"{engine} vs {eager}, batch {size}", "FAIL", str(exc)))
                continue
            sizes = {a["timing"]["batch_size"] for a in got}
            ok, detail = (compare_detections if task == "detect" else compare_top_k)(
                [a["result"] for a in got], [a["result"] for a in want], precision)
            rows.append(Row(f"{engine} vs {eager}, batch {size}", "pass" if ok else "FAIL",
                            f"{detail}; engine ran batch size(s) {sorted(sizes)}"))
    return rows


def compare_detections(got: list[Any], want: list[Any], precision: str, conf: float = 0.25) -> tuple[bool, str]:
    """Greedy pairing by box (px) and score, same class first. Two classes whose scores tie at one
    anchor may swap (counted as ties); other unpaired boxes are allowed only near `conf`."""
    paired, ties, worst, stray = 0, 0, 0.0, 0
    for answer, expected in zip(got, want, strict=True):
        free = list(answer["detections"])
        for target in expected["detections"]:
            close = [d for d in free if _box_diff(d, target) <= BOX_PX[precision]
                     and abs(d["score"] - target["score"]) <= SCORE[precision]]
            match = next((d for d in close if d["class_id"] == target["class_id"]), close[0] if close else None)
            if match is None:
                stray += abs(target["score"] - conf) > SCORE[precision]
                continue
            free.remove(match)
            paired += 1
            ties += match["class_id"] != target["class_id"]
            worst = max(worst, _box_diff(match, target))
        stray += sum(abs(d["score"] - conf) > SCORE[precision] for d in free)
    detail = f"{paired} boxes paired ({ties} class ties), largest box difference {worst:.3f} px, {stray} unpaired"
    return stray == 0, detail


def _box_diff(a: dict[str, Any], b: dict[str, Any]) -> float:
    return float(max(abs(x - y) for x, y in zip(a["box"], b["box"], strict=True)))


def compare_top_k(got: list[Any], want: list[Any], precision: str) -> tuple[bool, str]:
    same, worst = 0, 0.0
    for answer, expected in zip(got, want, strict=True):
        ids = [e["class_id"] for e in answer["top_k"]] == [e["class_id"] for e in expected["top_k"]]
        gap = max(abs(a["score"] - b["score"]) for a, b in zip(answer["top_k"], expected["top_k"], strict=True))
        worst = max(worst, gap)
        same += ids or (precision == "fp16" and gap <= SCORE["fp16"])  # fp16 may swap near-ties
    ok = same == len(got) and worst <= SCORE[precision]
    return ok, f"top-k identical for {same}/{len(got)} images, largest score difference {worst:.2g}"


# -- the ledger against NVML -----------------------------------------------------------------------------


def metric(text: str, name: str, device: str) -> float:
    prefix = f'{name}{{device="{device}"}} '
    values = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(prefix)]
    return values[0] if values else 0.0


async def _load_and_sample(url: str, models: list[str], device: str, count: int) -> dict[str, float]:
    """Fire `count` requests at every model at once; sample /metrics until they are all answered."""
    payloads = images()
    batch = [payloads[i % len(payloads)] for i in range(count)]
    load = asyncio.gather(*(_predict(url, model, batch) for model in models))
    peaks = {"ledger": 0.0, "used": 0.0}
    async with httpx.AsyncClient(base_url=url, timeout=10) as client:
        while not load.done():
            text = (await client.get("/metrics")).text
            ledger = metric(text, "model_router_ledger_weights_bytes", device) + metric(
                text, "model_router_ledger_reserved_bytes", device)
            peaks["ledger"] = max(peaks["ledger"], ledger)
            peaks["used"] = max(peaks["used"], metric(text, "model_router_device_memory_used_bytes", device))
            await asyncio.sleep(0.05)
    await load
    return peaks


def ledger_vs_readings(url: str, device: str, baseline: int, models: list[str]) -> list[Row]:
    """The ledger's bookings beside the probe's readings (NVML on a GPU, host RAM on a CPU)."""
    source, gpu = ("NVML", True) if device.startswith("cuda") else ("host RAM", False)
    text = httpx.get(url + "/metrics").text
    weights = metric(text, "model_router_ledger_weights_bytes", device)
    used = metric(text, "model_router_device_memory_used_bytes", device)
    count = LOAD_REQUESTS["gpu" if gpu else "cpu"]
    peaks = asyncio.run(_load_and_sample(url, models, device, count))
    gib = 2**30
    grew, reserved = peaks["used"] - used, peaks["ledger"] - weights
    under = grew > reserved + 256 * 2**20
    return [
        Row(f"ledger weights vs {source} after load", "info",
            f"ledger {weights / gib:.2f} GiB booked; {source} shows the router took {(used - baseline) / gib:.2f} GiB "
            "(beyond the weights: CUDA context, cuBLAS/cuDNN workspaces, allocator caches)"),
        Row(f"ledger reservations vs {source} under load", ("warn" if under else "pass") if gpu else "info",
            f"{source} grew {grew / gib:.2f} GiB above the loaded level; the ledger reserved up to "
            f"{reserved / gib:.2f} GiB for running batches ({count} requests to each of {len(models)} models)"),
    ]


def memory_used(device: str) -> int:
    """The probe's reading before the router starts: the baseline its growth is measured from."""
    from router.scheduling.memory import HostMemoryProbe, NvmlProbe

    probe = NvmlProbe(device) if device.startswith("cuda") else HostMemoryProbe(device)
    try:
        return probe.read().used_bytes
    finally:
        probe.close()


# -- main ------------------------------------------------------------------------------------------------


def write_table(path: Path, rows: list[Row]) -> None:
    lines = ["| check | result | detail |", "| --- | --- | --- |"]
    lines += [f"| {r.check} | {r.result} | {r.detail.replace('|', '/')} |" for r in rows]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    print("\n".join(lines))


def skip_without_cuda(out: Path) -> int:
    """Every row skipped for want of CUDA, once what the checks import has imported."""
    import model_router_onnx.export  # noqa: F401  (the export step's own modules, run in a subprocess)

    import router.store  # noqa: F401

    out.mkdir(parents=True, exist_ok=True)
    reason = "no CUDA: torch.cuda.is_available() is False"
    checks = ["export yolov8n, resnet18 -> ONNX and TensorRT", "engines vs eager, batch 1 and 8",
              "ledger vs NVML under load"]
    write_table(out / "engines.md", [Row(check, "skipped", reason) for check in checks])
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--device", default="auto", help="cuda:N or cpu; auto: cuda:0 where CUDA is available")
    parser.add_argument("--skip-without-cuda", action="store_true",
                        help="with --device auto and no CUDA: write the rows as skipped instead of running on the CPU")
    args = parser.parse_args(argv)
    if args.device == "auto":
        import torch

        args.device = "cuda:0" if torch.cuda.is_available() else "cpu"
        if args.device == "cpu" and args.skip_without_cuda:
            return skip_without_cuda(args.out.resolve())
    out: Path = args.out.resolve()
    store = out / "store"
    out.mkdir(parents=True, exist_ok=True)
    from router.store import init_demo

    init_demo(store, progress=lambda line: None)
    rows, engines = export_models(store, out)
    fleet, pairs = serving_fleet(store, args.device, engines)
    baseline = memory_used(args.device)
    try:
        with router(fleet, out) as url:
            rows += compare_pairs(url, pairs)
            models = sorted({name for pair in pairs for name in pair[:2]})
            rows += ledger_vs_readings(url, args.device, baseline, models)
            described = httpx.get(url + "/models").json()["models"]
            (out / "models.json").write_text(json.dumps(described, indent=2), encoding="utf-8")
    except RuntimeError as exc:
        rows.append(Row("serve the engines through the router", "FAIL", str(exc)))
    write_table(out / "engines.md", rows)
    return 1 if any(row.result == "FAIL" for row in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
