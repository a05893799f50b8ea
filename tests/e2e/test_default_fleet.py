"""The default fleet (config/fleet.yaml) served as a new user would: real JPEG and PNG files from
examples/ posted to both vision models, the answers' documented shape, and the plugins' discovery."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from router.store import init_demo
from tests.conftest import REPO, RouterProcess, free_port, serve
from tests.test_images import png_header

pytestmark = pytest.mark.e2e

EXAMPLES = REPO / "examples"


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("store")
    init_demo(path, progress=lambda line: None)
    return path


def default_fleet(store: Path) -> str:
    """config/fleet.yaml as shipped, with its model store pointed at a freshly built demo store."""
    text = (REPO / "config" / "fleet.yaml").read_text(encoding="utf-8")
    assert "model_store: ../model_store" in text
    return text.replace("model_store: ../model_store", f"model_store: {store}")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, store: Path) -> Iterator[RouterProcess]:
    with serve(tmp_path_factory.mktemp("fleet"), default_fleet(store)) as process:
        yield process


def check_detection_answer(body: dict[str, object], width: int, height: int) -> None:
    result = body["result"]
    assert isinstance(result, dict) and result["image"] == {"width": width, "height": height}
    for detection in result["detections"]:
        assert set(detection) == {"box", "score", "class_id", "label"}
        x1, y1, x2, y2 = detection["box"]
        assert 0 <= x1 <= x2 <= width and 0 <= y1 <= y2 <= height
        assert 0 <= detection["score"] <= 1 and isinstance(detection["label"], str)


def check_classification_answer(body: dict[str, object]) -> None:
    result = body["result"]
    assert isinstance(result, dict) and len(result["top_k"]) == 5
    scores = [entry["score"] for entry in result["top_k"]]
    assert scores == sorted(scores, reverse=True) and all(0 <= s <= 1 for s in scores)
    assert all(set(entry) == {"class_id", "label", "score"} for entry in result["top_k"])


@pytest.mark.parametrize(("filename", "media_type", "size"),
                         [("street.jpg", "image/jpeg", (640, 480)), ("square.png", "image/png", (320, 320))])
def test_both_models_answer_real_images(server: RouterProcess, filename: str, media_type: str, size: tuple[int, int]) -> None:
    data = (EXAMPLES / filename).read_bytes()
    multipart = httpx.post(server.url + "/models/yolov8n/predict", files={"file": (filename, data, media_type)}, timeout=60)
    raw = httpx.post(server.url + "/models/yolov8n/predict", content=data, headers={"content-type": media_type}, timeout=60)
    assert multipart.status_code == raw.status_code == 200, multipart.text
    check_detection_answer(multipart.json(), *size)
    assert multipart.json()["result"] == raw.json()["result"]
    classified = httpx.post(server.url + "/models/resnet18/predict", content=data,
                            headers={"content-type": media_type}, timeout=60)
    assert classified.status_code == 200, classified.text
    check_classification_answer(classified.json())


def test_a_file_part_without_its_own_content_type_is_sniffed(server: RouterProcess) -> None:
    """Python requests' `files={"file": open("street.jpg", "rb")}`: a filename and no Content-Type."""
    data = (EXAMPLES / "street.jpg").read_bytes()
    body = (b"--b0undary\r\nContent-Disposition: form-data; name=\"file\"; filename=\"street.jpg\"\r\n\r\n"
            + data + b"\r\n--b0undary--\r\n")
    for model in ("resnet18", "yolov8n"):
        response = httpx.post(f"{server.url}/models/{model}/predict", content=body, timeout=60,
                              headers={"content-type": "multipart/form-data; boundary=b0undary"})
        assert response.status_code == 200, response.text


def test_bad_images_are_refused_and_the_models_keep_serving(server: RouterProcess) -> None:
    jpeg = (EXAMPLES / "street.jpg").read_bytes()
    cases = [(jpeg[: len(jpeg) // 2], "image/jpeg", 400), (b"GIF89a" + b"\0" * 64, "image/gif", 415),
             (b"not an image at all", "image/png", 400), (b"", "image/jpeg", 400),
             (png_header(100_000, 100_000), "image/png", 413)]  # a pixel bomb: 30 GB if decoded
    for body, media_type, status in cases:
        response = httpx.post(server.url + "/models/resnet18/predict", content=body,
                              headers={"content-type": media_type}, timeout=60)
        assert response.status_code == status, response.text
    assert httpx.post(server.url + "/models/resnet18/predict", content=jpeg,
                      headers={"content-type": "image/jpeg"}, timeout=60).status_code == 200


def test_installed_plugins_appear_in_the_model_list(server: RouterProcess) -> None:
    models = {m["name"]: m for m in httpx.get(server.url + "/models").json()["models"]}
    assert models["yolov8n"]["plugin"]["distribution"] == "vision-model-router-yolo"
    assert models["resnet18"]["plugin"]["distribution"] == "vision-model-router-resnet"
    assert models["yolov8n"]["state"] == models["resnet18"]["state"] == "ready"


def test_uninstalled_plugin_is_a_clear_start_up_error(tmp_path: Path, store: Path) -> None:
    """Uninstall the resnet plugin for real, serve the default fleet, then reinstall it."""
    config = tmp_path / "fleet.yaml"
    config.write_text(default_fleet(store), encoding="utf-8")
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    subprocess.run([*pip, "uninstall", "-y", "vision-model-router-resnet"], check=True, capture_output=True)
    try:
        result = subprocess.run(
            [sys.executable, "-m", "router", "serve", "--config", str(config), "--port", str(free_port())],
            cwd=REPO, capture_output=True, text=True, timeout=120, check=False,  # its exit status is the point
        )
    finally:
        subprocess.run([*pip, "install", "--no-deps", "--no-build-isolation", "-e", str(REPO / "plugins" / "resnet")],
                       check=True, capture_output=True)
    assert result.returncode == 2
    assert "models.resnet18.plugin: no plugin named 'resnet' is installed" in result.stderr
    assert "yolo" in result.stderr  # the installed ones are listed


def test_each_request_gets_one_structured_log_line(server: RouterProcess) -> None:
    data = (EXAMPLES / "street.jpg").read_bytes()
    for model in ("yolov8n", "resnet18"):
        response = httpx.post(server.url + f"/models/{model}/predict", content=data,
                              headers={"content-type": "image/jpeg", "X-Request-ID": f"log-{model}"}, timeout=60)
        assert response.status_code == 200
        lines = access_lines(server, f"log-{model}")
        assert len(lines) == 1, lines
        line = lines[0]
        assert line["model"] == model and line["status"] == 200 and line["input_bytes"] == len(data)
        assert (line["image_width"], line["image_height"]) == (640, 480)
        assert line["batch_size"] >= 1 and line["queue_wait_ms"] >= 0 and line["execution_ms"] > 0
        assert isinstance(line["memory_delta_bytes"], int)  # host RAM around the batch (NVML on a GPU)


def access_lines(server: RouterProcess, request_id: str) -> list[dict[str, object]]:
    """The access lines of one request; written just after the response, so wait for them briefly."""
    for _ in range(100):
        lines = [r for r in server.log_records() if r.get("request_id") == request_id and r.get("message") == "request"]
        if lines:
            return lines
        time.sleep(0.02)
    return []
