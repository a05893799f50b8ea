"""JSON nested 2,500 levels as one item, to JSON models over native HTTP, V2 `BYTES` (HTTP) and gRPC
`BYTES`: a 400 (`INVALID_ARGUMENT`) that says why, never a 500 with a RecursionError, and the next
request served. `toy` parses with the SDK's bounded loader (`router.sdk.loads_bounded`); `plain`
and `plain-isolated` with `json.loads`, as a plugin that skips it (the runtime turns the plugin's
RecursionError into the item's 400), in the server's process and in an instance process."""

from __future__ import annotations

import json
from collections.abc import Iterator

import grpc
import httpx
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from tests.conftest import RouterProcess, serve

pytestmark = pytest.mark.e2e

FLEET = """
models:
  toy:
    plugin: toy
    batch: {max_size: 4, max_delay_ms: 2}
  plain:
    plugin: scripted
    options: {stdlib_json: true}
    batch: {max_size: 4, max_delay_ms: 2}
  plain-isolated:
    plugin: scripted
    options: {stdlib_json: true}
    isolation: process
    batch: {max_size: 4, max_delay_ms: 2}
"""
DEPTH = 2_500  # deeper than json.loads can recurse (the interpreter's limit is 1,000)
DEEP = ('{"x": ' + "[" * DEPTH + "]" * DEPTH + ', "id": "deep"}').encode()
VALID = {"toy": json.dumps({"x": [0.5] * 16}).encode(), "plain": b'{"id": "fine"}', "plain-isolated": b'{"id": "fine"}'}
#: What each model's 400 says: the SDK's loader names the bound; the runtime, the plugin's error.
REASON = {"toy": "nests arrays and objects more than 100 levels deep",
          "plain": "could not be decoded: it nests too deeply (RecursionError)",
          "plain-isolated": "could not be decoded: it nests too deeply (RecursionError)"}
MODELS = sorted(VALID)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RouterProcess]:
    with serve(tmp_path_factory.mktemp("deep-items"), FLEET, env={"MODEL_ROUTER_LOG_FORMAT": "json"}) as process:
        yield process


def native(server: RouterProcess, model: str, body: bytes) -> httpx.Response:
    return httpx.post(f"{server.url}/models/{model}/predict", content=body,
                      headers={"content-type": "application/json"}, timeout=60)


def v2_http(server: RouterProcess, model: str, *items: bytes) -> httpx.Response:
    body = {"inputs": [{"name": "JSON", "datatype": "BYTES", "shape": [len(items)],
                        "data": [item.decode() for item in items]}]}
    return httpx.post(f"{server.url}/v2/models/{model}/infer", json=body, timeout=60)


def v2_grpc(server: RouterProcess, model: str, *items: bytes) -> grpcclient.InferResult:
    tensor = grpcclient.InferInput("JSON", [len(items)], "BYTES")
    tensor.set_data_from_numpy(np.array(items, dtype=np.object_))
    with grpcclient.InferenceServerClient(server.grpc_address) as client:
        return client.infer(model, [tensor], client_timeout=60)


def no_server_errors(server: RouterProcess) -> None:
    assert "Traceback" not in server.log() and "RecursionError" not in server.log().replace(
        "nests too deeply (RecursionError)", ""), server.log()[-3000:]
    assert not [r for r in server.log_records() if r.get("level") == "error"], server.log()[-3000:]


@pytest.mark.parametrize("model", MODELS)
def test_deep_json_as_a_native_body_is_400_and_the_next_request_is_served(server: RouterProcess, model: str) -> None:
    refused = native(server, model, DEEP)
    assert refused.status_code == 400, refused.text
    assert REASON[model] in refused.json()["detail"], refused.text
    served = native(server, model, VALID[model])
    assert served.status_code == 200, served.text
    no_server_errors(server)


@pytest.mark.parametrize("model", MODELS)
def test_deep_json_as_a_v2_bytes_item_is_400_for_that_item(server: RouterProcess, model: str) -> None:
    refused = v2_http(server, model, VALID[model], DEEP)
    assert refused.status_code == 400, refused.text
    error = refused.json()["error"]
    assert "item 1 of 2" in error and REASON[model] in error, error
    served = v2_http(server, model, VALID[model], VALID[model])
    assert served.status_code == 200, served.text
    no_server_errors(server)


@pytest.mark.parametrize("model", MODELS)
def test_deep_json_as_a_grpc_bytes_item_is_invalid_argument(server: RouterProcess, model: str) -> None:
    with pytest.raises(InferenceServerException) as refused:
        v2_grpc(server, model, DEEP)
    assert refused.value.status() == str(grpc.StatusCode.INVALID_ARGUMENT), refused.value
    assert REASON[model] in refused.value.message(), refused.value.message()
    answer = v2_grpc(server, model, VALID[model])
    assert answer.get_response().model_name == model
    no_server_errors(server)
