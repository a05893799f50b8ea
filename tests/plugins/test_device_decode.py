"""JPEG decoding on the model's device (issue 12, part 5): the selection, the fallbacks, and the
device path itself, run here on the CPU (torchvision's decoder, the same resize and letterbox
code); the nvJPEG runs are the `gpu` tests at the end (scripts/gpu-check.sh)."""

from __future__ import annotations

import io
import logging
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from model_router_resnet import ResNetOptions, ResNetPlugin
from model_router_resnet.processing import ClassifyProcessing
from model_router_yolo import YoloOptions, YoloPlugin
from model_router_yolo.processing import DetectSettings, YoloProcessing
from PIL import Image, ImageOps

from router.sdk import device_images
from router.sdk.device_images import EncodedJpeg, encoded_jpeg, orient_chw, use_device_decode
from router.sdk.images import open_image
from router.sdk.plugin import Payload, PluginContext
from tests.plugins.test_parity import CASES, asset, make, reference_rgb

CPU = torch.device("cpu")
LEVEL = 1 / 255 / min(0.229, 0.224, 0.225)


def jpeg(width: int = 96, height: int = 64, *, mode: str = "RGB", orientation: int = 1) -> bytes:
    pixels = np.random.default_rng(width).integers(0, 256, (height, width, 3), dtype=np.uint8)
    exif = Image.Exif()
    if orientation != 1:
        exif[0x0112] = orientation
    buffer = io.BytesIO()
    Image.fromarray(pixels).convert(mode).save(buffer, format="JPEG", quality=92, exif=exif)
    return buffer.getvalue()


def png(width: int = 96, height: int = 64) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (width, height), (10, 200, 30)).save(buffer, format="PNG")
    return buffer.getvalue()


# --- selection and fallbacks --------------------------------------------------------------------


def test_not_asked_for_means_host_decode() -> None:
    assert use_device_decode(False, "cuda:0", "m") is False


def test_asked_for_on_the_cpu_falls_back_to_the_host_and_says_why(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="router.sdk.device_images"):
        assert use_device_decode(True, "cpu", "m") is False
    assert "gpu_decode is set but its device is 'cpu'; decoding on the host" in caplog.text


def test_asked_for_on_cuda_without_cuda_falls_back(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with caplog.at_level(logging.WARNING, logger="router.sdk.device_images"):
        assert use_device_decode(True, "cuda:0", "m") is False
    assert "CUDA is not available" in caplog.text


def test_asked_for_on_a_visible_cuda_device_is_used(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert use_device_decode(True, "cuda:1", "m") is True


@pytest.mark.parametrize("body, kept", [
    (jpeg(), True), (jpeg(mode="L"), True), (png(), False), (jpeg(mode="CMYK"), False), (jpeg()[:-200], False),
])
def test_only_plain_complete_jpegs_stay_encoded(body: bytes, kept: bool) -> None:
    image = open_image(Payload(body, "application/octet-stream"))
    assert (encoded_jpeg(image, body) is not None) is kept


def test_jpegs_over_the_device_limit_decode_on_the_host(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(device_images, "DEVICE_DECODE_MAX_PIXELS", 96 * 64 - 1)
    body = jpeg()
    assert encoded_jpeg(open_image(Payload(body, "image/jpeg")), body) is None


def test_plugins_asked_for_gpu_decode_on_the_cpu_decode_on_the_host(demo_store: Path) -> None:
    resnet = ResNetPlugin(ResNetOptions(weights="resnet18.pt", gpu_decode=True), PluginContext("r", demo_store))
    resnet.load("cpu")
    yolo = YoloPlugin(YoloOptions(model="yolov8n.pt", imgsz=320, gpu_decode=True), PluginContext("y", demo_store))
    yolo.load("cpu")
    assert resnet.processing.device_decode is False and yolo.processing.device_decode is False
    assert isinstance(resnet.preprocess(Payload(jpeg(), "image/jpeg")), torch.Tensor)
    assert yolo.preprocess(Payload(jpeg(), "image/jpeg")).pixels is not None


# --- the device path, on the CPU ----------------------------------------------------------------


@pytest.mark.parametrize("orientation", range(1, 9))
def test_orientation_on_the_device_matches_pillow(orientation: int) -> None:
    body = jpeg(orientation=orientation)
    expected = np.asarray(ImageOps.exif_transpose(Image.open(io.BytesIO(body))).convert("RGB"))
    image = open_image(Payload(body, "image/jpeg"))
    item = encoded_jpeg(image, body)
    assert item is not None
    (decoded,) = device_images.decode_on_device([item], CPU)
    np.testing.assert_array_equal(decoded.permute(1, 2, 0).numpy(), expected)
    assert orient_chw(torch.zeros(3, 4, 5), orientation).shape[-2:] == ((5, 4) if orientation >= 5 else (4, 5))


@pytest.fixture(scope="module")
def photos() -> list[Payload]:
    sources = {name: asset(name) for name in ("bus.jpg", "zidane.jpg")}
    return [make(case, sources) for case in CASES if max(case.size) <= 2000]


def test_classify_on_the_device_matches_the_host_within_one_level(photos: list[Payload]) -> None:
    host, device = ClassifyProcessing(), ClassifyProcessing(device_decode=True)
    items = [device.preprocess(p) for p in photos]
    assert any(isinstance(i, EncodedJpeg) for i in items) and any(isinstance(i, torch.Tensor) for i in items)
    on_device = device.network_input(items, CPU)
    on_host = host.network_input([host.preprocess(p) for p in photos], CPU)
    error = (on_device - on_host).abs()
    assert float(error.max()) <= LEVEL + 1e-5 and float(error.mean()) < 0.2 * LEVEL


def test_letterbox_on_the_device_matches_the_host_within_one_level(photos: list[Payload]) -> None:
    names = [str(i) for i in range(80)]
    host = YoloProcessing(640, 32, names, DetectSettings())
    device = YoloProcessing(640, 32, names, DetectSettings(), device_decode=True)
    items = [device.preprocess(p) for p in photos]
    assert [(i.width, i.height) for i in items] == [reference_rgb(p).shape[1::-1] for p in photos]
    error = (device.network_input(items, CPU) - host.network_input([host.preprocess(p) for p in photos], CPU)).abs()
    assert float(error.max()) <= 1 / 255 + 1e-6 and float(error.mean()) < 0.1 / 255


# --- on a GPU (scripts/gpu-check.sh): not yet run on a GPU --------------------------------------


@pytest.mark.gpu
def test_nvjpeg_classify_matches_torchvision_with_the_same_top5(
    demo_store: Path, photos: list[Payload], record_property: Any
) -> None:
    import torchvision

    from tests.plugins.test_parity import same_top5

    plugin = ResNetPlugin(ResNetOptions(weights="resnet18.pt", gpu_decode=True), PluginContext("r", demo_store))
    plugin.load("cuda:0")
    assert plugin.processing.device_decode is True
    transforms = torchvision.models.ResNet18_Weights.IMAGENET1K_V1.transforms()
    expected = torch.stack([transforms(torch.from_numpy(reference_rgb(p).copy()).permute(2, 0, 1)) for p in photos])
    got = plugin.processing.network_input([plugin.preprocess(p) for p in photos], torch.device("cuda:0")).cpu()
    error = (got - expected).abs()
    record_property("figure", f"nvJPEG vs torchvision's host decode: mean {float(error.mean()) / LEVEL:.2f}, "
                              f"max {float(error.max()) / LEVEL:.2f} levels on {len(photos)} photos")
    assert float(error.mean()) < LEVEL and float(error.max()) < 8 * LEVEL  # nvJPEG's IDCT is not libjpeg's
    with torch.inference_mode():
        network = plugin.module.cpu()
        pairs = zip(network(got).softmax(1), network(expected).softmax(1), strict=True)
        assert all(same_top5(a, b) for a, b in pairs)


@pytest.mark.gpu
def test_nvjpeg_letterbox_gives_ultralytics_boxes(demo_store: Path, photos: list[Payload]) -> None:
    from ultralytics import YOLO

    from tests.plugins.test_parity import YOLO_CONF, ultralytics_predict
    from tests.plugins.test_yolo import assert_same_detections

    plugin = YoloPlugin(YoloOptions(model="yolov8n.pt", conf=YOLO_CONF, gpu_decode=True), PluginContext("y", demo_store))
    plugin.load("cuda:0")
    assert plugin.processing.device_decode is True
    reference = YOLO(str(demo_store / "yolov8n.pt"))
    items = [plugin.preprocess(p) for p in photos]
    for payload, item, output in zip(photos, items, plugin.predict_batch(items), strict=True):
        answer = plugin.postprocess(output, item)
        assert_same_detections(answer["detections"], ultralytics_predict(reference, payload), conf=YOLO_CONF)
