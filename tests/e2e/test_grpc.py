"""The Open Inference Protocol over gRPC against a real server, through `tritonclient.grpc` used as a
Triton user would: health, metadata, inference on the default fleet's detector and classifier (the
same answers as tritonclient.http gives), the repository on a dynamic fleet, streams, overload and
deadlines, API keys in metadata, and grpc.health.v1."""

from __future__ import annotations

import json
import queue
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from grpc_health.v1 import health_pb2, health_pb2_grpc
from tritonclient.grpc import model_config_pb2, service_pb2
from tritonclient.utils import InferenceServerException

from router.sdk.images import decode_image
from router.sdk.plugin import Payload
from tests.conftest import REPO, RouterProcess, read_records, serve
from tests.e2e.test_kserve import assert_same

pytestmark = pytest.mark.e2e

EXAMPLES = REPO / "examples"
TOY_FLEET = """
models:
  echo:
    plugin: scripted
    options: {{record: "{record}"}}
    batch: {{max_size: 8, max_delay_ms: 20}}
  slow:
    plugin: scripted
    options: {{hang_on: hang, hang_ms: 1500, record: "{record}"}}
    queue: {{max_size: 1}}
    batch: {{max_size: 1}}
  narrow:
    plugin: scripted
    options: {{fixed_ms: 1000}}
    queue: {{max_size: 1}}
    batch: {{max_size: 1}}
  late:
    plugin: scripted
    options: {{hang_on: hang, hang_ms: 1500, record: "{record}"}}
    batch: {{max_size: 1}}
  lazy:
    plugin: scripted
    residency: on_demand
"""
USER, ADMIN = "user-key-0123456789abcdef", "admin-key-0123456789abcdef"


@pytest.fixture(scope="module")
def fleet_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RouterProcess]:
    """config/fleet.yaml as shipped (yolov8n and resnet18) on the demo store (`make test` builds it)."""
    text = (REPO / "config" / "fleet.yaml").read_text(encoding="utf-8")
    store = REPO / "model_store"
    with serve(tmp_path_factory.mktemp("fleet"), text.replace("model_store: ../model_store", f"model_store: {store}")) as process:
        yield process


@pytest.fixture(scope="module")
def record(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("records") / "batches.jsonl"


@pytest.fixture(scope="module")
def toy_server(tmp_path_factory: pytest.TempPathFactory, record: Path) -> Iterator[RouterProcess]:
    with serve(tmp_path_factory.mktemp("toy"), TOY_FLEET.format(record=record)) as process:
        yield process


def grpc_client(server: RouterProcess) -> grpcclient.InferenceServerClient:
    return grpcclient.InferenceServerClient(server.grpc_address)


def http_client(server: RouterProcess) -> httpclient.InferenceServerClient:
    return httpclient.InferenceServerClient(server.url.removeprefix("http://"))


def image_bytes(module: Any, *names: str) -> Any:
    tensor = module.InferInput("IMAGE", [len(names)], "BYTES")
    tensor.set_data_from_numpy(np.array([(EXAMPLES / n).read_bytes() for n in names], dtype=np.object_))
    return tensor


def pixels(module: Any, array: np.ndarray[Any, Any]) -> Any:
    tensor = module.InferInput("IMAGE", list(array.shape), "UINT8")
    tensor.set_data_from_numpy(array)
    return tensor


def documents(module: Any, *ids: str) -> Any:
    tensor = module.InferInput("JSON", [len(ids)], "BYTES")
    tensor.set_data_from_numpy(np.array([json.dumps({"id": i}).encode() for i in ids], dtype=np.object_))
    return tensor


def answers(result: Any) -> list[Any]:
    return [json.loads(element) for element in result.as_numpy("OUTPUT")]


def ids(result: Any) -> list[str]:
    """The ids the scripted plugin echoes back."""
    return [answer["id"] for answer in answers(result)]


def grpc_error(call: Any) -> InferenceServerException:
    with pytest.raises(InferenceServerException) as caught:
        call()
    return caught.value


# -- the default fleet: a detector and a classifier ----------------------------------------------------------


def test_health_metadata_config_and_statistics(fleet_server: RouterProcess) -> None:
    triton = grpc_client(fleet_server)
    assert triton.is_server_live() and triton.is_server_ready()
    assert triton.is_model_ready("yolov8n") and triton.is_model_ready("resnet18", model_version="1")
    assert not triton.is_model_ready("no-such-model") and not triton.is_model_ready("resnet18", model_version="2")
    assert triton.get_server_metadata(as_json=True)["extensions"] == http_client(fleet_server).get_server_metadata()["extensions"]
    metadata = triton.get_model_metadata("resnet18", as_json=True)
    assert metadata["name"] == "resnet18" and metadata["platform"] == "model-router/resnet"
    assert metadata["inputs"] == [{"name": "IMAGE", "datatype": "BYTES", "shape": ["-1"]}]  # int64 as JSON text
    config = triton.get_model_config("yolov8n").config
    assert (config.name, config.backend, config.max_batch_size) == ("yolov8n", "yolo", 4)
    assert [(g.kind, g.count) for g in config.instance_group] == [(model_config_pb2.ModelInstanceGroup.KIND_CPU, 1)]
    error = grpc_error(lambda: triton.get_model_metadata("yolov8n", model_version="2"))
    assert error.status() == "StatusCode.NOT_FOUND" and error.message() == "model 'yolov8n' has no version '2'; versions: 1"
    before = triton.get_inference_statistics("resnet18").model_stats[0]
    triton.infer("resnet18", [image_bytes(grpcclient, "street.jpg", "square.png")])
    after = triton.get_inference_statistics("resnet18").model_stats[0]
    assert after.inference_count == before.inference_count + 2
    assert after.inference_stats.success.count == before.inference_stats.success.count + 2
    assert after.execution_count >= before.execution_count + 1


@pytest.mark.parametrize("model", ["yolov8n", "resnet18"])
def test_jpeg_bytes_and_uint8_pixels_answer_as_over_http(fleet_server: RouterProcess, model: str) -> None:
    over_grpc = answers(grpc_client(fleet_server).infer(model, [image_bytes(grpcclient, "street.jpg", "square.png")],
                                                        request_id="parity-1"))
    over_http = answers(http_client(fleet_server).infer(model, [image_bytes(httpclient, "street.jpg", "square.png")]))
    assert_same(over_grpc, over_http)
    decoded = decode_image(Payload((EXAMPLES / "square.png").read_bytes(), "image/png"))[None]  # [1, H, W, 3]
    [grpc_pixels] = answers(grpc_client(fleet_server).infer(model, [pixels(grpcclient, decoded)]))
    [http_pixels] = answers(http_client(fleet_server).infer(model, [pixels(httpclient, decoded)]))
    assert_same(grpc_pixels, http_pixels)
    assert_same(grpc_pixels, over_http[1])  # decoded pixels answer as the PNG they came from


def test_the_request_id_comes_back(fleet_server: RouterProcess) -> None:
    result = grpc_client(fleet_server).infer("resnet18", [image_bytes(grpcclient, "square.png")], request_id="frame-7")
    assert result.get_response().id == "frame-7" and result.get_response().model_version == "1"


def test_errors_carry_the_routers_message_and_code(fleet_server: RouterProcess) -> None:
    triton = grpc_client(fleet_server)
    unknown = grpc_error(lambda: triton.infer("nope", [image_bytes(grpcclient, "square.png")]))
    assert unknown.status() == "StatusCode.NOT_FOUND" and unknown.message() == (
        "no model or pipeline named 'nope'; models: resnet18, yolov8n; pipelines: detect-classify")
    floats = grpcclient.InferInput("IMAGE", [1, 2, 2, 3], "FP32")
    floats.set_data_from_numpy(np.zeros((1, 2, 2, 3), dtype=np.float32))
    wrong = grpc_error(lambda: triton.infer("resnet18", [floats]))
    assert wrong.status() == "StatusCode.INVALID_ARGUMENT"
    assert wrong.message() == "input 'IMAGE' of model 'resnet18' must be BYTES [N] or UINT8 [N,H,W,3], got FP32 [1, 2, 2, 3]"
    two = grpcclient.InferInput("IMAGE", [2], "BYTES")
    two.set_data_from_numpy(np.array([(EXAMPLES / "street.jpg").read_bytes(), b"not an image"], dtype=np.object_))
    item = grpc_error(lambda: triton.infer("resnet18", [two]))
    assert item.status() == "StatusCode.INVALID_ARGUMENT" and item.message().startswith("item 1 of 2: corrupt or truncated image")
    assert grpc_error(lambda: triton.get_log_settings()).status() == "StatusCode.UNIMPLEMENTED"


# -- the repository, streams, overload and deadlines --------------------------------------------------------------


def test_index_load_and_unload_on_the_dynamic_fleet(toy_server: RouterProcess) -> None:
    triton = grpc_client(toy_server)
    states = {m.name: m.state for m in triton.get_model_repository_index().models}
    assert states == {"echo": "READY", "slow": "READY", "narrow": "READY", "late": "READY", "lazy": "UNAVAILABLE"}
    triton.load_model("lazy")
    assert triton.is_model_ready("lazy")
    assert {m.name: m.state for m in triton.get_model_repository_index().models}["lazy"] == "READY"
    assert ids(triton.infer("lazy", [documents(grpcclient, "a")])) == ["a"]
    triton.unload_model("lazy")
    assert not triton.is_model_ready("lazy")
    assert {m.name: m.state for m in triton.get_model_repository_index().models}["lazy"] == "UNAVAILABLE"
    assert grpc_error(lambda: triton.load_model("nope")).status() == "StatusCode.NOT_FOUND"


def test_a_streamed_sequence_of_frames_is_answered_in_order(toy_server: RouterProcess, record: Path) -> None:
    """Twenty frames and one for an unknown model among them: each answered, in order, the bad one
    with its error while the stream goes on; the frames shared batches."""
    got: queue.Queue[tuple[Any, Any]] = queue.Queue()
    triton = grpc_client(toy_server)
    triton.start_stream(callback=lambda result, error: got.put((result, error)))
    ids = [f"stream-{i}" for i in range(20)]
    for index, frame in enumerate(ids):
        triton.async_stream_infer("nope" if index == 7 else "echo", [documents(grpcclient, frame)], request_id=frame)
    triton.stop_stream()  # waits for every answer
    results = [got.get(timeout=10) for _ in ids]
    assert got.empty()
    assert results[7][0] is None and "no model named 'nope'" in results[7][1].message()
    served = [(r.get_response().id, answers(r)[0]["id"]) for r, e in results if e is None]
    assert served == [(frame, frame) for index, frame in enumerate(ids) if index != 7]
    batches = [row["ids"] for row in read_records(record) if set(row["ids"]) <= set(ids)]  # type: ignore[arg-type]
    assert max(len(batch) for batch in batches) > 1


def _blocked(server: RouterProcess, model: str, ids: list[str]) -> list[threading.Thread]:
    """HTTP requests that occupy `model` (the first hangs its batch), each in a thread."""
    threads = [threading.Thread(target=httpx.post, args=(f"{server.url}/models/{model}/predict",),
                                kwargs={"json": {"id": i}, "timeout": 30}) for i in ids]
    for thread in threads:
        thread.start()
        _wait_until(server, model, lambda m: any(i["busy"] for i in m["instances"]))
    return threads


def _wait_until(server: RouterProcess, model: str, condition: Any) -> None:
    for _ in range(500):  # polls a condition; the hung batch lasts 1.5 s
        if condition(httpx.get(f"{server.url}/models/{model}", timeout=5).json()):
            return
        threading.Event().wait(0.01)
    raise AssertionError(f"model {model!r} never reached the state")


def test_a_full_queue_is_unavailable_with_the_retry_hint(toy_server: RouterProcess) -> None:
    blockers = _blocked(toy_server, "slow", ["hang"])
    queued = threading.Thread(target=httpx.post, args=(f"{toy_server.url}/models/slow/predict",),
                              kwargs={"json": {"id": "queued"}, "timeout": 30})
    queued.start()
    try:
        _wait_until(toy_server, "slow", lambda m: m["queue"]["depth"] == 1)
        with grpc.insecure_channel(toy_server.grpc_address) as channel:
            infer = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer",
                                        request_serializer=service_pb2.ModelInferRequest.SerializeToString,
                                        response_deserializer=service_pb2.ModelInferResponse.FromString)
            request = service_pb2.ModelInferRequest(model_name="slow", inputs=[service_pb2.ModelInferRequest.InferInputTensor(
                name="JSON", datatype="BYTES", shape=[1], contents=service_pb2.InferTensorContents(bytes_contents=[b"{}"]))])
            with pytest.raises(grpc.RpcError) as caught:
                infer(request, timeout=10)
        assert caught.value.code() is grpc.StatusCode.UNAVAILABLE, caught.value.details()
        assert "full" in caught.value.details()
        trailing = dict(caught.value.trailing_metadata())
        assert int(trailing["retry-after"]) >= 1 and int(trailing["grpc-retry-pushback-ms"]) > 0
    finally:
        for thread in [*blockers, queued]:
            thread.join(30)


def test_a_client_deadline_shorter_than_the_queue_is_deadline_exceeded_and_never_runs(
    toy_server: RouterProcess, record: Path,
) -> None:
    """On a model whose hung batch the deadline gate has not measured (it would refuse the request at
    once, UNAVAILABLE, once it has): the request waits in the queue until its deadline passes."""
    blockers = _blocked(toy_server, "late", ["hang"])
    try:
        triton = grpc_client(toy_server)
        late = grpc_error(lambda: triton.infer("late", [documents(grpcclient, "late-client")], client_timeout=0.3))
        assert late.status() == "StatusCode.DEADLINE_EXCEEDED"
        # The request's own timeout (microseconds): the server decides, and says so.
        own = grpc_error(lambda: triton.infer("late", [documents(grpcclient, "late-own")], timeout=100_000))
        assert own.status() == "StatusCode.DEADLINE_EXCEEDED"
        assert own.message() == "deadline passed after 100 ms in the queue of model 'late'; the input was not run"
    finally:
        for thread in blockers:
            thread.join(30)
    ran = {i for row in read_records(record) for i in row["ids"]}  # type: ignore[attr-defined]
    assert "hang" in ran and not ran & {"late-client", "late-own"}


def test_a_full_model_answers_a_frame_with_its_error_and_the_stream_goes_on(toy_server: RouterProcess) -> None:
    """The first frame runs (a batch takes a second), the second fills the queue of one, the third is
    refused in the stream; a frame sent after them is answered on the same stream."""
    got: queue.Queue[tuple[Any, Any]] = queue.Queue()
    triton = grpc_client(toy_server)
    triton.start_stream(callback=lambda result, error: got.put((result, error)))
    try:
        triton.async_stream_infer("narrow", [documents(grpcclient, "first")], request_id="first")
        _wait_until(toy_server, "narrow", lambda m: any(i["busy"] for i in m["instances"]))
        for frame in ("second", "third"):
            triton.async_stream_infer("narrow", [documents(grpcclient, frame)], request_id=frame)
        results = [got.get(timeout=10) for _ in range(3)]
        assert [ids(result) if error is None else None for result, error in results[:2]] == [["first"], ["second"]]
        result, error = results[2]
        assert result is None and error.message() == "model 'narrow' queue is full (1 requests); retry later (retry after 1 s)"
        triton.async_stream_infer("narrow", [documents(grpcclient, "after")], request_id="after")
        result, error = got.get(timeout=10)
        assert error is None and ids(result) == ["after"]
    finally:
        triton.stop_stream()


# -- API keys and health --------------------------------------------------------------------------------------


def test_api_keys_travel_in_metadata(tmp_path: Path) -> None:
    env = {"MODEL_ROUTER_API_KEYS": USER, "MODEL_ROUTER_ADMIN_KEYS": ADMIN}
    with serve(tmp_path, "models:\n  echo: {plugin: scripted}\n", env=env) as server:
        triton = grpc_client(server)
        assert triton.is_server_live()  # health is open unless protected
        assert grpc_error(lambda: triton.infer("echo", [documents(grpcclient, "a")])).status() == "StatusCode.UNAUTHENTICATED"
        wrong = {"authorization": "Bearer not-a-key-0123456789"}
        assert grpc_error(lambda: triton.get_model_metadata("echo", headers=wrong)).status() == "StatusCode.UNAUTHENTICATED"
        user = {"authorization": f"Bearer {USER}"}
        assert ids(triton.infer("echo", [documents(grpcclient, "a")], headers=user)) == ["a"]
        denied = grpc_error(lambda: triton.unload_model("echo", headers=user))
        assert denied.status() == "StatusCode.PERMISSION_DENIED" and denied.message() == "this action needs the admin key"
        triton.load_model("echo", headers={"authorization": f"Bearer {ADMIN}"})
        got: queue.Queue[tuple[Any, Any]] = queue.Queue()
        triton.start_stream(callback=lambda result, error: got.put((result, error)))  # no key: refused as it opens
        result, error = got.get(timeout=10)
        assert result is None and error.status() == "StatusCode.UNAUTHENTICATED"
        triton.stop_stream()


def health(server: RouterProcess, service: str = "") -> Any:
    with grpc.insecure_channel(server.grpc_address) as channel:
        return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status


def test_grpc_health_reflects_readiness(tmp_path: Path) -> None:
    fleet = "models:\n  slowload: {plugin: scripted, options: {load_ms: 2000}}\n"
    with serve(tmp_path, fleet, wait_ready=False) as server:
        assert health(server) == health_pb2.HealthCheckResponse.NOT_SERVING  # still loading
        for _ in range(300):  # polls readiness, as an orchestrator does
            if health(server) == health_pb2.HealthCheckResponse.SERVING:
                break
            threading.Event().wait(0.05)
        assert health(server) == health(server, "inference.GRPCInferenceService") == health_pb2.HealthCheckResponse.SERVING
        assert health(server, "slowload") == health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(grpc.RpcError) as caught:
            health(server, "no.such.Service")
        assert caught.value.code() is grpc.StatusCode.NOT_FOUND
