"""Where a V2 request is decoded and split into items: a small one (a body of at most
SMALL_REQUEST_BYTES, reading no shared memory) on the event loop, whose hand-off to a thread
would cost more than the decoding; a larger one, or one that reads shared memory, on a thread.
Observed by the thread each step runs on, through the app in process (HTTP) and over gRPC's
codec function the same way."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import pytest
from litestar.testing import TestClient

from router.http.app import create_app
from router.http.kserve import routes
from router.inference_protocol import submission
from router.inference_protocol.submission import SMALL_REQUEST_BYTES, is_small, off_loop
from tests.test_runtime import make_runtime

FLEET = """
models:
  m: {plugin: scripted, options: {fixed_ms: 1}}
"""


def _on_loop() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


@pytest.fixture
def where(monkeypatch: pytest.MonkeyPatch) -> dict[str, list[bool]]:
    """For each step (decode, payloads), whether each call ran on the event loop's thread."""
    seen: dict[str, list[bool]] = {"decode": [], "payloads": []}

    def watched(step: str, fn: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            seen[step].append(_on_loop())
            return fn(*args, **kwargs)
        return call

    monkeypatch.setattr(routes, "decode_request", watched("decode", routes.decode_request))
    monkeypatch.setattr(submission, "to_payloads", watched("payloads", submission.to_payloads))
    return seen


def _until_ready(client: TestClient[Any]) -> None:
    for _ in range(500):
        if client.get("/health/ready").status_code == 200:
            return
        time.sleep(0.01)
    raise AssertionError("the app did not become ready")


def _infer(ident: str, pad: int = 0) -> dict[str, Any]:
    document = json.dumps({"id": ident, "pad": "x" * pad})
    return {"inputs": [{"name": "JSON", "datatype": "BYTES", "shape": [1], "data": [document]}]}


def test_a_small_request_is_decoded_on_the_loop_and_a_large_one_on_a_thread(
    tmp_path: Path, where: dict[str, list[bool]],
) -> None:
    with TestClient(app=create_app(make_runtime(tmp_path, FLEET))) as client:
        _until_ready(client)
        small = client.post("/v2/models/m/infer", json=_infer("small"))
        large = client.post("/v2/models/m/infer", json=_infer("large", pad=SMALL_REQUEST_BYTES))
    for answer, ident in ((small, "small"), (large, "large")):
        assert answer.status_code == 200, answer.text
        assert json.loads(answer.json()["outputs"][0]["data"][0])["id"] == ident
    assert where == {"decode": [True, False], "payloads": [True, False]}


def test_a_request_that_reads_shared_memory_is_decoded_on_a_thread_however_small(
    tmp_path: Path, where: dict[str, list[bool]],
) -> None:
    body = {"inputs": [{"name": "JSON", "datatype": "BYTES", "shape": [1],
                        "parameters": {"shared_memory_region": "nope", "shared_memory_byte_size": 16}}]}
    with TestClient(app=create_app(make_runtime(tmp_path, FLEET))) as client:
        _until_ready(client)
        answer = client.post("/v2/models/m/infer", json=body)
    assert answer.status_code == 403  # the test client is not on loopback: refused as the region is read
    assert where["decode"] == [False]


def test_the_rule_and_the_hand_off() -> None:
    assert is_small(SMALL_REQUEST_BYTES, shared_memory=False)
    assert not is_small(SMALL_REQUEST_BYTES + 1, shared_memory=False)
    assert not is_small(10, shared_memory=True)

    async def run() -> tuple[bool, bool]:
        return await off_loop(True, _on_loop), await off_loop(False, _on_loop)

    assert asyncio.run(run()) == (True, False)
