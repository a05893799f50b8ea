"""The Open Inference Protocol against a real server, through `tritonclient.http` used as a Triton
user would: health, metadata, JSON and binary inference on the default fleet's detector and
classifier (same answers as the native endpoint), batches, parameters and errors."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from router.sdk.images import decode_image
from router.sdk.plugin import Payload
from router.store import init_demo
from tests.conftest import REPO, RouterProcess, read_records, serve

pytestmark = pytest.mark.e2e

EXAMPLES = REPO / "examples"
IMAGES = {"street.jpg": "image/jpeg", "square.png": "image/png"}
TOY_FLEET = """
models:
  toy:
    plugin: toy
    batch: {{max_size: 4, max_delay_ms: 2}}
  echo:
    plugin: scripted
    options: {{record: "{record}"}}
    batch: {{max_size: 8, max_delay_ms: 200}}
  slow:
    plugin: scripted
    options: {{hang_on: hang, hang_ms: 1500}}
    batch: {{max_size: 1}}
"""


@pytest.fixture(scope="module")
def fleet_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RouterProcess]:
    """config/fleet.yaml as shipped (yolov8n and resnet18), on a freshly built demo store."""
    store = tmp_path_factory.mktemp("store")
    init_demo(store, progress=lambda line: None)
    text = (REPO / "config" / "fleet.yaml").read_text(encoding="utf-8")
    assert "model_store: ../model_store" in text
    with serve(tmp_path_factory.mktemp("fleet"), text.replace("model_store: ../model_store", f"model_store: {store}")) as process:
        yield process


@pytest.fixture(scope="module")
def record(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("records") / "batches.jsonl"


@pytest.fixture(scope="module")
def toy_server(tmp_path_factory: pytest.TempPathFactory, record: Path) -> Iterator[RouterProcess]:
    with serve(tmp_path_factory.mktemp("toy"), TOY_FLEET.format(record=record)) as process:
        yield process


def client(server: RouterProcess) -> httpclient.InferenceServerClient:
    return httpclient.InferenceServerClient(server.url.removeprefix("http://"))


def native(server: RouterProcess, model: str, body: bytes, media_type: str) -> Any:
    response = httpx.post(f"{server.url}/models/{model}/predict", content=body, headers={"content-type": media_type},
                          timeout=60)
    assert response.status_code == 200, response.text
    return response.json()["result"]


def assert_same(got: Any, expected: Any, where: str = "result") -> None:
    """Equal structure, labels and ids; floats equal to float32 rounding (batch composition may differ)."""
    if isinstance(expected, float):
        assert got == pytest.approx(expected, rel=1e-4, abs=1e-4), where
    elif isinstance(expected, dict):
        assert isinstance(got, dict) and got.keys() == expected.keys(), where
        for key in expected:
            assert_same(got[key], expected[key], f"{where}.{key}")
    elif isinstance(expected, list):
        assert isinstance(got, list) and len(got) == len(expected), where
        for index, (g, e) in enumerate(zip(got, expected, strict=True)):
            assert_same(g, e, f"{where}[{index}]")
    else:
        assert got == expected, where


def encoded_images(*names: str) -> httpclient.InferInput:
    tensor = httpclient.InferInput("IMAGE", [len(names)], "BYTES")
    tensor.set_data_from_numpy(np.array([(EXAMPLES / n).read_bytes() for n in names], dtype=np.object_))
    return tensor


def answers(result: httpclient.InferResult) -> list[Any]:
    return [json.loads(element) for element in result.as_numpy("OUTPUT")]


# -- the default fleet: a detector and a classifier ----------------------------------------------------------


def test_health_and_metadata(fleet_server: RouterProcess) -> None:
    triton = client(fleet_server)
    assert triton.is_server_live() and triton.is_server_ready()
    assert triton.is_model_ready("yolov8n") and triton.is_model_ready("resnet18", model_version="1")
    assert not triton.is_model_ready("no-such-model")
    assert triton.get_server_metadata()["extensions"] == ["binary_tensor_data", "model_repository", "system_shared_memory",
                                                          "statistics"]
    metadata = triton.get_model_metadata("resnet18")
    assert metadata["name"] == "resnet18" and metadata["versions"] == ["1"] and metadata["platform"] == "model-router/resnet"
    assert metadata["inputs"] == [{"name": "IMAGE", "datatype": "BYTES", "shape": [-1]}]
    assert metadata["outputs"] == [{"name": "OUTPUT", "datatype": "BYTES", "shape": [-1]}]
    assert triton.get_model_metadata("yolov8n", model_version="1")["platform"] == "model-router/yolo"
    with pytest.raises(InferenceServerException) as caught:
        triton.get_model_metadata("yolov8n", model_version="2")
    assert caught.value.status() == "404" and caught.value.message() == "model 'yolov8n' has no version '2'; versions: 1"
    index = triton.get_model_repository_index()
    assert {(m["name"], m["state"]) for m in index} == {("yolov8n", "READY"), ("resnet18", "READY"),
                                                        ("detect-classify", "READY")}  # the default fleet's pipeline


@pytest.mark.parametrize("model", ["yolov8n", "resnet18"])
@pytest.mark.parametrize("filename", list(IMAGES))
def test_binary_mode_matches_the_native_endpoint(fleet_server: RouterProcess, model: str, filename: str) -> None:
    """tritonclient's defaults: binary input, no requested outputs, so binary output."""
    result = client(fleet_server).infer(model, [encoded_images(filename)], request_id="parity-1")
    assert result.get_response()["id"] == "parity-1"
    assert result.get_response()["outputs"][0]["parameters"]["binary_data_size"] > 0
    [answer] = answers(result)
    assert_same(answer, native(fleet_server, model, (EXAMPLES / filename).read_bytes(), IMAGES[filename]))


@pytest.mark.parametrize("model", ["yolov8n", "resnet18"])
def test_json_mode_with_decoded_pixels_matches_the_native_endpoint(fleet_server: RouterProcess, model: str) -> None:
    data = (EXAMPLES / "square.png").read_bytes()
    pixels = decode_image(Payload(data, "image/png"))[None]  # [1, H, W, 3]
    tensor = httpclient.InferInput("IMAGE", list(pixels.shape), "UINT8")
    tensor.set_data_from_numpy(pixels, binary_data=False)
    output = httpclient.InferRequestedOutput("OUTPUT", binary_data=False)
    result = client(fleet_server).infer(model, [tensor], outputs=[output])
    assert "data" in result.get_response()["outputs"][0]  # all JSON: no binary section
    [answer] = answers(result)
    assert_same(answer, native(fleet_server, model, data, "image/png"))


def test_a_batch_of_images_comes_back_in_order(fleet_server: RouterProcess) -> None:
    result = client(fleet_server).infer("yolov8n", [encoded_images("street.jpg", "square.png", "street.jpg")])
    got = answers(result)
    assert [a["image"] for a in got] == [{"width": 640, "height": 480}, {"width": 320, "height": 320},
                                         {"width": 640, "height": 480}]
    for answer, name in zip(got, ["street.jpg", "square.png", "street.jpg"], strict=True):
        assert_same(answer, native(fleet_server, "yolov8n", (EXAMPLES / name).read_bytes(), IMAGES[name]))


def expect_error(call: Any, status: int) -> str:
    with pytest.raises(InferenceServerException) as caught:
        call()
    assert caught.value.status() == str(status), caught.value.message()
    message: str = caught.value.message()
    return message


def test_errors_carry_the_routers_message(fleet_server: RouterProcess) -> None:
    triton = client(fleet_server)
    truncated = httpclient.InferInput("IMAGE", [1], "BYTES")
    truncated.set_data_from_numpy(np.array([(EXAMPLES / "street.jpg").read_bytes()[:2000]], dtype=np.object_))
    floats = httpclient.InferInput("IMAGE", [1, 2, 2, 3], "FP32")
    floats.set_data_from_numpy(np.zeros((1, 2, 2, 3), dtype=np.float32))
    wrong_name = httpclient.InferInput("INPUT__0", [1], "BYTES")
    wrong_name.set_data_from_numpy(np.array([b"x"], dtype=np.object_))

    assert expect_error(lambda: triton.infer("nope", [truncated]), 404) == (
        "no model or pipeline named 'nope'; models: resnet18, yolov8n; pipelines: detect-classify")
    assert expect_error(lambda: triton.infer("resnet18", [truncated]), 400).startswith("corrupt or truncated image data")
    assert expect_error(lambda: triton.infer("resnet18", [floats]), 400) == (
        "input 'IMAGE' of model 'resnet18' must be BYTES [N] or UINT8 [N,H,W,3], got FP32 [1, 2, 2, 3]")
    assert expect_error(lambda: triton.infer("resnet18", [wrong_name]), 400) == (
        "model 'resnet18' takes one input named 'IMAGE', got ['INPUT__0']")
    two = encoded_images("street.jpg", "street.jpg")
    two.set_data_from_numpy(np.array([(EXAMPLES / "street.jpg").read_bytes(), b"not an image"], dtype=np.object_))
    assert expect_error(lambda: triton.infer("resnet18", [two]), 400).startswith("item 1 of 2: corrupt or truncated image")
    assert expect_error(lambda: triton.load_model("nope"), 404) == "no model named 'nope'; models: resnet18, yolov8n"
    triton.load_model("resnet18")  # loaded already: nothing to do
    assert triton.is_model_ready("resnet18")  # still serving


# -- a JSON model, batching, parameters ---------------------------------------------------------------------


def test_named_tensors_reach_a_json_model_as_its_native_json(toy_server: RouterProcess) -> None:
    rows = np.random.default_rng(1).normal(size=(3, 16)).astype(np.float32)
    expected = [native(toy_server, "toy", json.dumps({"x": row.tolist()}).encode(), "application/json") for row in rows]
    for binary in (True, False):
        tensor = httpclient.InferInput("x", [3, 16], "FP32")
        tensor.set_data_from_numpy(rows, binary_data=binary)
        assert_same(answers(client(toy_server).infer("toy", [tensor])), expected)


def test_items_share_the_batcher_and_come_back_in_order(toy_server: RouterProcess, record: Path) -> None:
    ids = [f"item-{i}" for i in range(6)]
    tensor = httpclient.InferInput("JSON", [len(ids)], "BYTES")
    tensor.set_data_from_numpy(np.array([json.dumps({"id": i}).encode() for i in ids], dtype=np.object_))
    got = answers(client(toy_server).infer("echo", [tensor], priority=1, timeout=5_000_000))
    assert [a["id"] for a in got] == ids
    batches = [row["ids"] for row in read_records(record) if set(row["ids"]) <= set(ids)]  # type: ignore[arg-type]
    assert sorted(i for batch in batches for i in batch) == ids
    assert max(len(batch) for batch in batches) > 1  # one request's items were batched together


def test_parameters_are_checked_with_clear_messages(toy_server: RouterProcess) -> None:
    tensor = httpclient.InferInput("JSON", [1], "BYTES")
    tensor.set_data_from_numpy(np.array([b'{"id": "p"}'], dtype=np.object_))
    triton = client(toy_server)
    assert expect_error(lambda: triton.infer("echo", [tensor], priority=4), 400) == (
        "parameter 'priority' must be 0 (the default) or 1..3 (1 is the highest), got 4")
    assert expect_error(lambda: triton.infer("echo", [tensor], sequence_id=9), 400) == (
        "parameter 'sequence_id': sequence batching is not supported")


def test_expired_deadline_is_503_with_retry_after(toy_server: RouterProcess) -> None:
    """A request still queued behind a hung batch when its `timeout` (microseconds) passes."""
    blocker = threading.Thread(target=httpx.post, args=(f"{toy_server.url}/models/slow/predict",),
                               kwargs={"json": {"id": "hang"}, "timeout": 30})
    blocker.start()
    try:
        _wait_until_busy(toy_server, "slow")
        tensor = httpclient.InferInput("JSON", [1], "BYTES")
        tensor.set_data_from_numpy(np.array([b'{"id": "late"}'], dtype=np.object_))
        message = expect_error(lambda: client(toy_server).infer("slow", [tensor], timeout=100_000), 503)
        assert message == "deadline passed after 100 ms in the queue of model 'slow'; the input was not run"
        raw = httpx.post(f"{toy_server.url}/v2/models/slow/infer", timeout=10, json={
            "inputs": [{"name": "JSON", "datatype": "BYTES", "shape": [1], "data": ['{"id": "late"}']}],
            "parameters": {"timeout": 50_000}})
        assert raw.status_code == 503 and raw.headers["retry-after"] == "1"
        assert raw.json() == {"error": "deadline passed after 50 ms in the queue of model 'slow'; the input was not run"}
    finally:
        blocker.join(30)


def _wait_until_busy(server: RouterProcess, model: str) -> None:
    for _ in range(300):  # polls a condition; the hung batch lasts 1.5 s
        described = httpx.get(f"{server.url}/models/{model}", timeout=5).json()
        if any(instance["busy"] for instance in described["instances"]):
            return
        threading.Event().wait(0.01)
    raise AssertionError(f"model {model!r} never started its batch")


def test_compressed_requests_are_inflated(toy_server: RouterProcess) -> None:
    """tritonclient's request_compression_algorithm; asking for a compressed response gets a plain one, which it reads."""
    tensor = httpclient.InferInput("x", [1, 16], "FP32")
    tensor.set_data_from_numpy(np.ones((1, 16), dtype=np.float32))
    plain = answers(client(toy_server).infer("toy", [tensor]))
    for algorithm in ("gzip", "deflate"):
        result = client(toy_server).infer("toy", [tensor], request_compression_algorithm=algorithm,
                                          response_compression_algorithm=algorithm)
        assert answers(result) == plain
    bad = httpx.post(f"{toy_server.url}/v2/models/toy/infer", content=b"not gzip", timeout=10,
                     headers={"content-encoding": "gzip", "content-type": "application/json"})
    assert bad.status_code == 400 and bad.json()["error"].startswith("the gzip request body is corrupt")


def test_v2_errors_use_their_shape_and_native_errors_keep_theirs(toy_server: RouterProcess) -> None:
    v2 = httpx.get(f"{toy_server.url}/v2/models/nope", timeout=10)
    assert v2.status_code == 404 and v2.json() == {"error": "no model named 'nope'; models: echo, slow, toy"}
    native_error = httpx.get(f"{toy_server.url}/models/nope", timeout=10)
    assert native_error.status_code == 404 and set(native_error.json()) == {"detail", "request_id"}
    assert httpx.get(f"{toy_server.url}/v2/health/live", timeout=10).status_code == 200
