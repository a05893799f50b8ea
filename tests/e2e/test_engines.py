"""End-to-end with engines: both demo models exported by `model-router export`, served by a real
router beside their eager originals, answers compared at batch 1 and 8; a mixed eager + ONNX fleet
sharing one memory budget; a TensorRT model that cannot start on this machine."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest

from router.sdk.images import example_jpeg
from router.sdk.plugin import Payload
from router.store import init_demo
from tests.conftest import REPO, RouterProcess, metric_value, serve
from tests.plugins.test_yolo import assert_same_detections

pytestmark = pytest.mark.e2e

CONF = 0.1
SOURCE_FLEET = """
model_store: {store}
models:
  yolov8n:
    plugin: yolo
    options: {{model: yolov8n.pt, imgsz: 320, conf: {conf}, max_det: 3000}}
    batch: {{max_size: 8}}
  resnet18:
    plugin: resnet
    options: {{weights: resnet18.pt}}
    batch: {{max_size: 8}}
"""


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The demo checkpoints, and both exported to ONNX through the command line."""
    path = tmp_path_factory.mktemp("store")
    init_demo(path, progress=lambda line: None)
    config = path / "source-fleet.yaml"
    config.write_text(SOURCE_FLEET.format(store=path, conf=CONF), encoding="utf-8")
    for model, fmt in (("yolov8n", "onnx"), ("resnet18", "auto")):
        result = subprocess.run(
            [sys.executable, "-m", "router", "export", "--config", str(config), "--model", model, "--format", fmt],
            check=False, cwd=REPO, capture_output=True, text=True, timeout=300,
        )
        assert result.returncode == 0, result.stderr[-3000:]
        assert result.stdout.splitlines()[0] == str(path / f"{model}.onnx")
        assert "[4/4]" in result.stderr and "vs PyTorch at batch 8" in result.stderr
        if fmt == "auto":  # an engine where TensorRT and a GPU are present, else a line saying why not
            assert "skipped the TensorRT engine" in result.stderr or "[3/3]" in result.stderr
    return path


def images() -> list[Payload]:
    """The two example files and six generated JPEGs of different shapes."""
    files = [Payload((REPO / "examples" / name).read_bytes(), media) for name, media in
             (("street.jpg", "image/jpeg"), ("square.png", "image/png"))]
    sizes = [(320, 240), (200, 360), (500, 300), (96, 96), (640, 360), (256, 256)]
    return files + [example_jpeg(w, h, seed=i) for i, (w, h) in enumerate(sizes)]


async def predict_all(url: str, model: str, payloads: list[Payload]) -> list[dict[str, Any]]:
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        responses = await asyncio.gather(*(
            client.post(f"/models/{model}/predict", content=p.body, headers={"content-type": p.media_type})
            for p in payloads
        ))
    assert [r.status_code for r in responses] == [200] * len(payloads), responses[0].text
    return [r.json() for r in responses]


SERVING_FLEET = """
model_store: {store}
models:
  yolo-eager:
    plugin: yolo
    options: {{model: yolov8n.pt, imgsz: 320, conf: {conf}, max_det: 3000}}
    batch: {{max_size: 8, max_delay_ms: 1500}}
  yolo-onnx:
    plugin: onnx
    options: {{model: yolov8n.onnx}}
    batch: {{max_size: 8, max_delay_ms: 1500}}
  resnet-eager:
    plugin: resnet
    options: {{weights: resnet18.pt}}
    batch: {{max_size: 8, max_delay_ms: 1500}}
  resnet-onnx:
    plugin: onnx
    options: {{model: resnet18.onnx}}
    batch: {{max_size: 8, max_delay_ms: 1500}}
  detector-trt:
    plugin: tensorrt
    device: cpu
    options: {{engine: yolov8n.engine}}
    required: false
"""


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, store: Path) -> Any:
    with serve(tmp_path_factory.mktemp("serving"), SERVING_FLEET.format(store=store, conf=CONF)) as process:
        yield process


def served(server: RouterProcess, model: str, payloads: list[Payload], batch_size: int) -> list[dict[str, Any]]:
    """Answers for `payloads`, sent together (batch_size 8) or one by one (1); checks the batch sizes ran."""
    if batch_size == 1:
        answers = [asyncio.run(predict_all(server.url, model, [p]))[0] for p in payloads[:2]]
    else:
        answers = asyncio.run(predict_all(server.url, model, payloads))
    assert {a["timing"]["batch_size"] for a in answers} == {batch_size}, [a["timing"] for a in answers]
    return [a["result"] for a in answers]


@pytest.mark.parametrize("batch_size", [1, 8])
def test_onnx_detector_answers_like_the_eager_one(server: RouterProcess, batch_size: int) -> None:
    payloads = images()
    onnx, eager = served(server, "yolo-onnx", payloads, batch_size), served(server, "yolo-eager", payloads, batch_size)
    for got, expected in zip(onnx, eager, strict=True):
        assert got["image"] == expected["image"]
        assert_same_detections(got["detections"], expected["detections"], conf=CONF)
    assert sum(len(answer["detections"]) for answer in eager) > 0, "the comparison needs detections"


@pytest.mark.parametrize("batch_size", [1, 8])
def test_onnx_classifier_answers_like_the_eager_one(server: RouterProcess, batch_size: int) -> None:
    payloads = images()
    onnx = served(server, "resnet-onnx", payloads, batch_size)
    eager = served(server, "resnet-eager", payloads, batch_size)
    for got, expected in zip(onnx, eager, strict=True):
        assert [e["class_id"] for e in got["top_k"]] == [e["class_id"] for e in expected["top_k"]]
        assert all(abs(g["score"] - e["score"]) <= 1e-4 for g, e in zip(got["top_k"], expected["top_k"], strict=True))


def test_tensorrt_model_that_cannot_start_is_a_clear_error_and_others_serve(server: RouterProcess) -> None:
    models = {m["name"]: m for m in httpx.get(server.url + "/models").json()["models"]}
    trt = models["detector-trt"]
    assert trt["state"] == "failed" and trt["plugin"]["distribution"] == "vision-model-router-tensorrt"
    assert "model 'detector-trt': the tensorrt plugin cannot start" in trt["error"]
    assert "device 'cpu' is not a CUDA device" in trt["error"]
    assert models["yolo-onnx"]["plugin"]["distribution"] == "vision-model-router-onnx"
    assert all(models[name]["state"] == "ready" for name in ("yolo-onnx", "resnet-onnx", "yolo-eager", "resnet-eager"))
    assert httpx.get(server.url + "/health/ready").status_code == 200
    refused = httpx.post(server.url + "/models/detector-trt/predict", content=images()[0].body,
                         headers={"content-type": "image/jpeg"})
    assert refused.status_code == 503 and "tensorrt plugin cannot start" in refused.json()["detail"]


# -- one device, one budget, eager and ONNX models ------------------------------------------------------

MB = 1_000_000
MIXED_FLEET = """
model_store: {store}
devices:
  cpu: {{probe: none, memory_budget: 100MB, max_concurrent_batches: 2}}  # the budget alone decides
models:
  eager:
    plugin: resnet
    options: {{weights: resnet18.pt}}
    batch: {{max_size: 1}}
    memory: {{weights: 10MB, per_item: {per_item}}}
  onnx:
    plugin: onnx
    options: {{model: resnet18.onnx}}
    batch: {{max_size: 1}}
    memory: {{weights: 10MB, per_item: {per_item}}}
"""


@pytest.mark.parametrize(("per_item", "may_overlap"), [(50 * MB, False), (30 * MB, True)])
def test_eager_and_onnx_models_share_one_budget(tmp_path: Path, store: Path, per_item: int, may_overlap: bool) -> None:
    """Budget 100 MB, weights 2 x 10 MB: two batches of 50 MB cannot run together, two of 30 MB can.

    The proof is the ledger's peak (`model_router_ledger_peak_bytes`): a batch holds its reservation
    from before it starts until after its thread has returned, and the peak is taken at every
    reservation. Had two batches ever run at the same moment, the later one's reservation would have
    been made while the earlier one's was still held, so the peak would be weights + both batches.
    A peak of weights + one batch therefore means no two batches ever overlapped; a peak of weights
    + two means they did run together.
    """
    payloads = images()
    with serve(tmp_path, MIXED_FLEET.format(store=store, per_item=per_item)) as server:

        async def run() -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
            return await asyncio.gather(predict_all(server.url, "eager", payloads), predict_all(server.url, "onnx", payloads))

        eager, onnx = asyncio.run(run())
        metrics = httpx.get(server.url + "/metrics").text
    for got, expected in zip(onnx, eager, strict=True):  # both really ran the network
        assert [e["class_id"] for e in got["result"]["top_k"]] == [e["class_id"] for e in expected["result"]["top_k"]]
    peak = metric_value(metrics, "model_router_ledger_peak_bytes", device="cpu")
    assert metric_value(metrics, "model_router_ledger_weights_bytes", device="cpu") == 20 * MB
    assert metric_value(metrics, "model_router_ledger_reserved_bytes", device="cpu") == 0
    assert metric_value(metrics, "model_router_batch_size_count", model="eager") == len(payloads)
    assert metric_value(metrics, "model_router_batch_size_count", model="onnx") == len(payloads)
    if may_overlap:
        assert peak == 20 * MB + 2 * per_item, "batches that fit together should have run concurrently"
    else:
        assert peak == 20 * MB + per_item, f"batches over budget overlapped: ledger peak {peak}"
