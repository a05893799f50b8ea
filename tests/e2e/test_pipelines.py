"""Pipelines through a real server: the default fleet's detect-classify on real photos against the
same plugins called in a loop, crops of concurrent requests sharing the classifier's batches (from
/metrics), V2, the model list, the access line, the live page, admin changes and 409; and with the
test kit's scripted models, the deadline's 504 (crops never run) and the door's 503."""

from __future__ import annotations

import json
import math
import queue
import re
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import httpx
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
import ultralytics
from grpc_health.v1 import health_pb2, health_pb2_grpc
from tritonclient.utils import InferenceServerException

from router.sdk import PIXELS_MEDIA_TYPE, Payload, PluginContext, decode_image
from router.serving.plan import load_plan
from router.store import init_demo
from tests.conftest import REPO, RouterProcess, metric_value, serve
from tests.e2e.test_kserve import assert_same

pytestmark = pytest.mark.e2e

PHOTOS = Path(ultralytics.__file__).parent / "assets"  # bus.jpg and zidane.jpg ship with ultralytics
PIPELINE = "detect-classify"
CLASSIFY_STEP = "2:resnet18"


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The demo weights: the repository's model store when built (make test builds it), else a fresh one."""
    if all((REPO / "model_store" / name).is_file() for name in ("yolov8n.pt", "resnet18.pt")):
        return REPO / "model_store"
    path = tmp_path_factory.mktemp("store")
    init_demo(path, progress=lambda line: None)
    return path


@pytest.fixture(scope="module")
def fleet_file(tmp_path_factory: pytest.TempPathFactory, store: Path) -> Path:
    """config/fleet.yaml as shipped, on the demo store, with every time limit at 60 s: on two shared
    cores sixteen concurrent photos must not meet a deadline, which other tests are about."""
    text = (REPO / "config" / "fleet.yaml").read_text(encoding="utf-8")
    assert "model_store: ../model_store" in text and f"  {PIPELINE}:" in text
    text = re.sub(r"timeout_ms: \d+", "timeout_ms: 60000", text.replace("model_store: ../model_store", f"model_store: {store}"))
    path = tmp_path_factory.mktemp("fleet") / "fleet.yaml"
    path.write_text(text, encoding="utf-8")
    return path


#: One process, and a split host (two fronts, one engine: the pipeline runner runs in the fronts).
WORKERS = [pytest.param("1", id="one-process"), pytest.param("2", id="split-host")]


@pytest.fixture(scope="module", params=WORKERS)
def server(fleet_file: Path, request: pytest.FixtureRequest) -> Iterator[RouterProcess]:
    with serve(fleet_file.parent, fleet_file.read_text(encoding="utf-8"), timeout=180,
               env={"MODEL_ROUTER_WORKERS": request.param}) as process:
        yield process


def predict(server: RouterProcess, name: str, photo: str, **headers: str) -> httpx.Response:
    return httpx.post(f"{server.url}/models/{name}/predict", content=(PHOTOS / photo).read_bytes(), timeout=120,
                      headers={"content-type": "image/jpeg", **headers})


# -- the same answer as the plugins called in a loop -------------------------------------------------


def direct_chain(fleet_file: Path, photo: str) -> list[dict[str, Any]]:
    """detect, crop, classify each crop: the fleet's plugin classes with its options, one input at a time."""
    plan = load_plan(fleet_file)
    plugins = {}
    for name in ("yolov8n", "resnet18"):
        model = plan.models[name]
        plugins[name] = model.plugin.cls(model.options, PluginContext(name, plan.fleet.model_store))
        plugins[name].load("cpu")
    detector, classifier = plugins["yolov8n"], plugins["resnet18"]
    payload = Payload((PHOTOS / photo).read_bytes(), "image/jpeg")
    item = detector.preprocess(payload)
    detections = detector.postprocess(detector.predict_batch([item])[0], item)["detections"]
    crop = plan.fleet.pipelines[PIPELINE].steps[1].options
    pixels = decode_image(payload)
    height, width = pixels.shape[:2]
    chosen = []
    for detection in sorted(detections, key=lambda d: -d["score"]):
        x1, y1, x2, y2 = detection["box"]
        pad_x, pad_y = (x2 - x1) * crop["padding"], (y2 - y1) * crop["padding"]
        box = [max(0, math.floor(x1 - pad_x)), max(0, math.floor(y1 - pad_y)),
               min(width, math.ceil(x2 + pad_x)), min(height, math.ceil(y2 + pad_y))]
        if detection["score"] >= crop["min_score"] and min(box[2] - box[0], box[3] - box[1]) >= crop["min_size"]:
            chosen.append((detection, box))
    answers = []
    for detection, (left, top, right, bottom) in chosen[:crop["max_items"]]:
        cut = classifier.preprocess(Payload(b"", PIXELS_MEDIA_TYPE, pixels=pixels[top:bottom, left:right]))
        classified = classifier.postprocess(classifier.predict_batch([cut])[0], cut)
        answers.append({**detection, "crop_box": [left, top, right, bottom], "resnet18": classified})
    return answers


def assert_same_chain(got: list[dict[str, Any]], expected: list[dict[str, Any]]) -> None:
    """Item for item: the same detections, crops and classes; coordinates and scores equal up to the
    float noise of batch composition and thread count (a thousandth of a pixel, of a probability)."""
    assert len(got) == len(expected)
    for index, (g, e) in enumerate(zip(got, expected, strict=True)):
        where = f"detections[{index}]"
        assert g.keys() == e.keys(), where
        assert (g["label"], g["class_id"]) == (e["label"], e["class_id"]), where
        assert g["box"] == pytest.approx(e["box"], abs=0.05) and g["score"] == pytest.approx(e["score"], abs=1e-3), where
        assert all(abs(a - b) <= 1 for a, b in zip(g["crop_box"], e["crop_box"], strict=True)), where
        classes = [(c["label"], c["class_id"]) for c in g["resnet18"]["top_k"]]
        assert classes == [(c["label"], c["class_id"]) for c in e["resnet18"]["top_k"]], where
        assert [c["score"] for c in g["resnet18"]["top_k"]] == pytest.approx(
            [c["score"] for c in e["resnet18"]["top_k"]], abs=1e-3), where


@pytest.mark.parametrize("photo", ["bus.jpg", "zidane.jpg"])
def test_the_router_answers_as_the_plugins_chained_by_hand(server: RouterProcess, fleet_file: Path, photo: str) -> None:
    response = predict(server, PIPELINE, photo)
    assert response.status_code == 200, response.text
    body = response.json()
    expected = direct_chain(fleet_file, photo)
    assert expected, "the demo detector found nothing to crop"
    assert_same_chain(body["result"]["detections"], expected)
    assert body["pipeline"] == PIPELINE and body["result"]["crop"]["kept"] == len(expected)
    steps = {s["step"]: s for s in body["timing"]["steps"]}
    assert steps["0:yolov8n"]["items"] == 1 and steps[CLASSIFY_STEP]["items"] == len(expected)


def test_crops_of_concurrent_requests_share_the_classifiers_batches(server: RouterProcess) -> None:
    """Sixteen clients at once: the classifier's mean batch is larger than one request's crops."""
    labels = {"pipeline": PIPELINE, "step": CLASSIFY_STEP}

    def figures() -> tuple[float, float, float, float]:
        text = httpx.get(server.url + "/metrics", timeout=30).text
        return (metric_value(text, "model_router_pipeline_step_batch_size_sum", **labels),
                metric_value(text, "model_router_pipeline_step_batch_size_count", **labels),
                metric_value(text, "model_router_batch_size_sum", model="resnet18"),
                metric_value(text, "model_router_batch_size_count", model="resnet18"))

    before = figures()
    with ThreadPoolExecutor(16) as pool:
        responses = list(pool.map(lambda i: predict(server, PIPELINE, ("bus.jpg", "zidane.jpg")[i % 2]), range(32)))
    after = figures()
    assert [r.status_code for r in responses] == [200] * 32, [r.text for r in responses if r.status_code != 200][:2]
    per_request = max(len(r.json()["result"]["detections"]) for r in responses)
    item_batch = (after[0] - before[0]) / (after[1] - before[1])  # the batch each crop ran in, on average
    model_batch = (after[2] - before[2]) / (after[3] - before[3])
    assert item_batch > per_request and model_batch > per_request / 2 and model_batch > 2, (item_batch, model_batch)


# -- everywhere a model is -----------------------------------------------------------------------


def test_a_pipeline_is_a_model_to_v2_clients(server: RouterProcess) -> None:
    triton = httpclient.InferenceServerClient(server.url.removeprefix("http://"))
    metadata = triton.get_model_metadata(PIPELINE)
    assert metadata["platform"] == "ensemble" and metadata["inputs"][0]["name"] == "IMAGE"
    assert triton.is_model_ready(PIPELINE)
    assert (PIPELINE, "READY") in {(m["name"], m["state"]) for m in triton.get_model_repository_index()}
    tensor = httpclient.InferInput("IMAGE", [1], "BYTES")
    tensor.set_data_from_numpy(np.array([(PHOTOS / "zidane.jpg").read_bytes()], dtype=np.object_))
    [answer] = [json.loads(e) for e in triton.infer(PIPELINE, [tensor]).as_numpy("OUTPUT")]
    assert_same(answer, predict(server, PIPELINE, "zidane.jpg").json()["result"])


def test_a_pipeline_is_a_model_to_grpc_clients_too(server: RouterProcess) -> None:
    """tritonclient.grpc sees detect-classify as tritonclient.http does: its metadata, readiness, its
    line in the index and its health; bus.jpg gets the same answer unary and streamed as over HTTP
    V2, and every request counts in the one runner the HTTP routes show."""
    triton, over_http = grpcclient.InferenceServerClient(server.grpc_address), http_v2(server)
    metadata = triton.get_model_metadata(PIPELINE, as_json=True)
    assert (metadata["name"], metadata["platform"]) == (PIPELINE, "ensemble")
    assert [i["name"] for i in metadata["inputs"]] == [i["name"] for i in over_http.get_model_metadata(PIPELINE)["inputs"]]
    assert triton.is_model_ready(PIPELINE) and not triton.is_model_ready(PIPELINE, model_version="2")
    assert (PIPELINE, "READY") in {(m.name, m.state) for m in triton.get_model_repository_index().models}
    with grpc.insecure_channel(server.grpc_address) as channel:
        status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=PIPELINE), timeout=10)
    assert status.status == health_pb2.HealthCheckResponse.SERVING
    before = httpx.get(f"{server.url}/pipelines/{PIPELINE}", timeout=30).json()["requests"].get("ok", 0)

    [over_grpc] = v2_answers(triton.infer(PIPELINE, [photo_tensor(grpcclient, "bus.jpg")], client_timeout=120))
    [expected] = v2_answers(over_http.infer(PIPELINE, [photo_tensor(httpclient, "bus.jpg")]))
    assert expected["detections"] and all("resnet18" in d for d in expected["detections"])
    assert_same(over_grpc, expected)
    got: queue.Queue[tuple[Any, Any]] = queue.Queue()
    triton.start_stream(callback=lambda result, error: got.put((result, error)))
    triton.async_stream_infer(PIPELINE, [photo_tensor(grpcclient, "bus.jpg")], request_id="frame-0")
    triton.stop_stream()
    result, error = got.get(timeout=120)
    assert error is None, error
    assert_same(v2_answers(result), [expected])
    assert httpx.get(f"{server.url}/pipelines/{PIPELINE}", timeout=30).json()["requests"]["ok"] == before + 3


def test_an_unknown_name_lists_the_models_and_the_pipelines(server: RouterProcess) -> None:
    """Where a name could be a model's or a pipeline's, its 404 lists both: the native route (from the
    connection and from the app), the model's own route, V2 over HTTP and over gRPC."""
    expected = f"no model or pipeline named 'nope'; models: resnet18, yolov8n; pipelines: {PIPELINE}"
    assert predict(server, "nope", "bus.jpg").json()["detail"] == expected  # refused from the headers
    twice = [("content-type", "image/jpeg"), ("x-request-id", "a"), ("x-request-id", "b")]  # left to the app's check
    in_app = httpx.post(f"{server.url}/models/nope/predict", timeout=30, headers=twice, content=b"\xff\xd8")
    assert (in_app.status_code, in_app.json()["detail"]) == (404, expected)
    assert httpx.get(f"{server.url}/models/nope", timeout=30).json()["detail"] == expected
    assert httpx.get(f"{server.url}/v2/models/nope", timeout=30).json()["error"] == expected
    triton = grpcclient.InferenceServerClient(server.grpc_address)
    with pytest.raises(InferenceServerException) as caught:
        triton.infer("nope", [photo_tensor(grpcclient, "bus.jpg")])
    assert caught.value.status() == "StatusCode.NOT_FOUND" and caught.value.message() == expected


def http_v2(server: RouterProcess) -> httpclient.InferenceServerClient:
    return httpclient.InferenceServerClient(server.url.removeprefix("http://"), network_timeout=120)


def photo_tensor(module: Any, photo: str) -> Any:
    tensor = module.InferInput("IMAGE", [1], "BYTES")
    tensor.set_data_from_numpy(np.array([(PHOTOS / photo).read_bytes()], dtype=np.object_))
    return tensor


def v2_answers(result: Any) -> list[Any]:
    return [json.loads(element) for element in result.as_numpy("OUTPUT")]


def test_a_pipeline_is_listed_logged_measured_and_shown(server: RouterProcess) -> None:
    assert predict(server, PIPELINE, "bus.jpg", **{"X-Request-ID": "pipeline-line"}).status_code == 200
    listed = httpx.get(server.url + "/models", timeout=30).json()
    [pipeline] = [p for p in listed["pipelines"] if p["name"] == PIPELINE]
    assert pipeline["kind"] == "pipeline" and pipeline["state"] == "ready" and pipeline["requests"]["ok"] >= 1
    assert pipeline["models"] == ["resnet18", "yolov8n"] and pipeline["entry"] == "yolov8n"
    assert httpx.get(f"{server.url}/models/{PIPELINE}", timeout=30).json()["steps"] == pipeline["steps"]
    assert httpx.get(f"{server.url}/pipelines/{PIPELINE}", timeout=30).json()["name"] == PIPELINE
    [line] = server.access_lines("pipeline-line")
    assert line["status"] == 200 and line["pipeline"] == PIPELINE and line["steps"]["0:yolov8n"] == 1
    assert line["items"] == 1 + line["steps"][CLASSIFY_STEP]
    metrics = httpx.get(server.url + "/metrics", timeout=30).text
    assert metric_value(metrics, "model_router_pipeline_requests_total", pipeline=PIPELINE, outcome="ok") >= 1
    assert metric_value(metrics, "model_router_pipeline_step_items_count", pipeline=PIPELINE, step=CLASSIFY_STEP) >= 1
    shown = httpx.get(server.url + "/ui/state", timeout=30).json()["pipelines"]
    assert [(p["name"], p["chain"]) for p in shown] == [(PIPELINE, "yolov8n → crop → resnet18")]
    assert httpx.get(server.url + "/health/ready", timeout=30).json()["pipelines"] == {PIPELINE: "ready"}


def test_pipelines_change_at_run_time_and_keep_their_models(server: RouterProcess) -> None:
    section = {"steps": [{"model": "yolov8n"}, {"transform": "crop", "options": {"max_items": 1}}, {"model": "resnet18"}]}
    added = httpx.put(server.url + "/pipelines/best-box", json=section, timeout=60)
    assert added.status_code == 201 and added.json()["outcome"] == "added", added.text
    answer = predict(server, "best-box", "bus.jpg")
    assert answer.status_code == 200 and len(answer.json()["result"]["detections"]) == 1
    section["steps"][1]["options"] = {"max_items": 2}
    assert httpx.put(server.url + "/pipelines/best-box", json=section, timeout=60).json()["outcome"] == "changed"
    conflict = httpx.delete(server.url + "/models/resnet18", timeout=60)
    assert conflict.status_code == 409
    assert conflict.json()["detail"].startswith("model 'resnet18' is used by pipeline(s) best-box, detect-classify")
    bad = httpx.put(server.url + "/pipelines/bad", json={"steps": [{"model": "yolov8n"}, {"model": "resnet18"}]}, timeout=60)
    assert bad.status_code == 400 and "steps[1] is a model right after model yolov8n" in bad.json()["detail"]
    assert httpx.delete(server.url + "/pipelines/best-box", timeout=60).json() == {"deleted": "best-box"}
    assert predict(server, "best-box", "bus.jpg").status_code == 404


def test_a_pipeline_change_shows_on_every_front_once_it_returns(server: RouterProcess) -> None:
    """No front patches its copy of the fleet: a call returns once every front's snapshot shows it.
    Each request below is a new connection, which the kernel hands to either front of a split host."""
    statuses = []
    for n in range(6):
        name = f"classify-{n}"
        put = httpx.put(f"{server.url}/pipelines/{name}", json={"steps": [{"model": "resnet18"}]}, timeout=60)
        statuses.append((put.status_code, predict(server, name, "zidane.jpg").status_code))
        deleted = httpx.delete(f"{server.url}/pipelines/{name}", timeout=60)
        statuses.append((deleted.status_code, predict(server, name, "zidane.jpg").status_code))
    assert statuses == [(201, 200), (200, 404)] * 6


# -- one deadline, one door: scripted models -----------------------------------------------------------


SCRIPTED = """
models:
  boxes:
    plugin: boxes
    options: {{boxes: [[0, 0, 10, 10, 0.9], [10, 0, 30, 20, 0.8]], fixed_ms: {boxes_ms}}}
    queue: {{max_size: 1}}
    batch: {{max_size: 1}}
  pixels: {{plugin: pixels, options: {{fixed_ms: 1500, record: '{record}'}}}}
pipelines:
  quick: {{steps: [{{model: boxes}}, {{transform: crop}}, {{model: pixels}}], timeout_ms: 1000}}
"""


@pytest.fixture
def scripted(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[tuple[RouterProcess, Path]]:
    record = tmp_path / "pixels.jsonl"
    boxes_ms, workers = request.param
    with serve(tmp_path, SCRIPTED.format(boxes_ms=boxes_ms, record=record),
               env={"MODEL_ROUTER_WORKERS": workers}) as process:
        yield process, record


def photo_body() -> bytes:
    return (PHOTOS / "zidane.jpg").read_bytes()


@pytest.mark.parametrize("scripted", [(0, "1"), (0, "2")], indirect=True, ids=["one-process", "split-host"])
def test_a_step_that_cannot_finish_answers_504_and_its_crops_never_run(scripted: tuple[RouterProcess, Path]) -> None:
    server, record = scripted
    response = httpx.post(server.url + "/models/quick/predict", content=photo_body(),
                          headers={"content-type": "image/jpeg"}, timeout=30)
    assert response.status_code == 504, response.text
    assert response.json()["detail"].startswith("pipeline 'quick', step 2:pixels: model 'pixels' cannot answer before "
                                                "the deadline")
    # The crops were refused by the classifier's gate (its requests say so), so none was queued to run
    # later. In one process both are refused at once; on a split host the front refuses from the
    # board's figures, or (figures older than the rules trust) the engine does, and a crop whose
    # answer has not come back when the first 504 does is cancelled with its request.
    requests = httpx.get(server.url + "/models/pixels", timeout=10).json()["requests"]
    assert requests.get("deadline", 0) >= 1 and set(requests) <= {"deadline", "cancelled"}, requests
    assert sum(requests.values()) == 2, requests
    assert not record.exists() or record.read_text() == ""


@pytest.mark.parametrize("scripted", [(1500, "1"), (1500, "2")], indirect=True, ids=["one-process", "split-host"])
def test_a_full_first_step_answers_503_with_retry_after_at_the_door(scripted: tuple[RouterProcess, Path]) -> None:
    server, _ = scripted
    sent = [threading.Thread(target=httpx.post, args=(server.url + "/models/quick/predict",),
                             kwargs={"content": photo_body(), "headers": {"content-type": "image/jpeg"}, "timeout": 30})
            for _ in range(2)]
    def until(condition: Any) -> None:
        deadline = time.monotonic() + 20
        while True:
            boxes = httpx.get(server.url + "/models/boxes", timeout=10).json()
            if condition(boxes):
                return
            assert time.monotonic() < deadline, boxes
            time.sleep(0.02)

    sent[0].start()
    until(lambda boxes: boxes["instances"][0]["busy"])  # the first detection runs (1.5 s) ...
    sent[1].start()
    until(lambda boxes: boxes["queue"]["depth"] == 1)  # ... and the second waits: the queue of one is full
    refused = httpx.post(server.url + "/models/quick/predict", content=photo_body(),
                         headers={"content-type": "image/jpeg", "X-Request-ID": "door"}, timeout=30)
    assert refused.status_code == 503 and int(refused.headers["Retry-After"]) >= 1
    assert refused.json()["detail"].startswith("pipeline 'quick': model 'boxes' queue is full")
    assert server.access_lines("door")[0]["refused"] == "before the app"  # from the headers, the body unread
    for thread in sent:
        thread.join()


# -- the live page -----------------------------------------------------------------------------------


READ_PIPELINES = """(() => Object.fromEntries([...document.querySelectorAll('[data-pipeline]')].map((card) => [
  card.dataset.pipeline, Object.fromEntries([...card.querySelectorAll('[data-field]')].map(
    (n) => [n.dataset.field, n.dataset.value ?? n.textContent]))])))()"""


def test_the_live_page_shows_a_card_per_pipeline(tmp_path: Path) -> None:
    from tests.tools import require_program

    require_program("chromium", "chromium")
    from benchmarks.browser import Browser

    fleet = (SCRIPTED.format(boxes_ms=0, record=tmp_path / "pixels.jsonl")
             .replace("fixed_ms: 1500", "fixed_ms: 0").replace("timeout_ms: 1000", "timeout_ms: 10000"))
    with serve(tmp_path, fleet) as server, Browser(width=1500, height=900) as browser:
        browser.goto(f"{server.url}/ui?poll_ms=250")
        for _ in range(3):
            assert httpx.post(server.url + "/models/quick/predict", content=photo_body(),
                              headers={"content-type": "image/jpeg"}, timeout=30).status_code == 200
        browser.wait_for("Number(document.querySelector('[data-pipeline=quick] [data-field=total-200]')"
                         "?.textContent) === 3")
        card = browser.evaluate(READ_PIPELINES)["quick"]
    assert card["state"] == "ready" and card["chain"] == "boxes → crop → pixels"
    assert card["p50"] != "–" and float(card["items-2:pixels"]) == 2.0  # two crops per request
