"""Client and operator input that answered 500 (or was taken silently) before, against a real
server: lone surrogates, multipart parts that are not files, JSON whose parsed size dwarfs its text
(under a capped address space), nested or non-UTF-8 admin input and fleet files, a model added by
PUT that cannot load, instance counts and names without bound, and the V2 odds and ends. Each is a
clear 4xx (or a clean 503) with no traceback, and the server serves on."""

from __future__ import annotations

import gzip
import json
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from tests.conftest import RouterProcess, liveness_watched, serve

pytestmark = pytest.mark.e2e

FLEET = """
models:
  echo:
    plugin: scripted
    batch: {max_size: 8, max_delay_ms: 2}
"""
MB = 1 << 20
JSON = {"content-type": "application/json"}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RouterProcess]:
    # 20 MB bodies (the default), and an address space that eight parsed `[{},{},...]` bodies
    # (about 540 MB each) would exhaust.
    with serve(tmp_path_factory.mktemp("round2"), FLEET, memory_limit=3 * 1024 * MB) as process:
        yield process


def no_tracebacks(server: RouterProcess) -> None:
    assert "Traceback" not in server.log()
    assert not [r for r in server.log_records() if r.get("level") == "error"], server.log()[-2000:]


def v2(data: list[str], request_id: str | None = None) -> bytes:
    body: dict[str, object] = {"inputs": [{"name": "JSON", "datatype": "BYTES", "shape": [len(data)], "data": data}]}
    if request_id is not None:
        body["id"] = request_id
    return json.dumps(body, ensure_ascii=True).encode()


def infer(server: RouterProcess, body: bytes, headers: dict[str, str] | None = None) -> httpx.Response:
    return httpx.post(server.url + "/v2/models/echo/infer", content=body, headers=headers or JSON, timeout=60)


def still_serving(server: RouterProcess) -> None:
    answer = httpx.post(server.url + "/models/echo/predict", json={"id": "fine"}, timeout=10)
    assert answer.status_code == 200, answer.text


# -- lone surrogates ---------------------------------------------------------------------------------


@pytest.mark.parametrize("where", ["native", "v2 id", "v2 data", "raw bytes"])
def test_a_lone_surrogate_is_400(server: RouterProcess, where: str) -> None:
    if where == "native":
        answer = httpx.post(server.url + "/models/echo/predict", content=b'{"id": "\\ud800"}', headers=JSON)
        message = answer.json()["detail"]
    elif where == "v2 id":
        answer, message = infer(server, v2(['{"id": "a"}'], request_id="\ud800")), None
    elif where == "v2 data":
        answer, message = infer(server, v2(['{"id": "\udc00"}'])), None
    else:
        answer = httpx.post(server.url + "/models/echo/predict", content=b'{"id": "\xed\xa0\x80"}', headers=JSON)
        message = answer.json()["detail"]
    assert answer.status_code == 400, answer.text
    assert "lone surrogate" in (message or answer.json()["error"])
    paired = infer(server, v2(['{"id": "\U0001f600"}'], request_id="\U0001f600"))  # a pair is fine
    assert paired.status_code == 200 and paired.json()["id"] == "\U0001f600"
    no_tracebacks(server)


# -- multipart parts that are not files --------------------------------------------------------------


@pytest.mark.parametrize("disposition", [
    b'form-data; name="file"',  # no filename: read as text, and these bytes are not UTF-8
    b"form-data; name=\"file\"; filename*=UTF-8''photo.jpg",  # only the RFC 5987 form
], ids=["no-filename", "filename-star"])
def test_a_file_part_without_a_filename_is_400(server: RouterProcess, disposition: bytes) -> None:
    body = b"--b\r\nContent-Disposition: " + disposition + b"\r\n\r\n\xff\xd8\xff\xe0 not text\r\n--b--\r\n"
    answer = httpx.post(server.url + "/models/echo/predict", content=body,
                        headers={"content-type": "multipart/form-data; boundary=b"})
    assert answer.status_code == 400, answer.text
    assert "needs a filename" in answer.json()["detail"]
    charset = (b"--b\r\nContent-Disposition: form-data; name=\"file\"\r\nContent-Type: text/plain; charset=nonsense"
               b"\r\n\r\nabc\r\n--b--\r\n")
    assert httpx.post(server.url + "/models/echo/predict", content=charset,
                      headers={"content-type": "multipart/form-data; boundary=b"}).status_code == 400
    no_tracebacks(server)


# -- JSON that parses into far more than its size ----------------------------------------------------------


def test_eight_20_mb_bodies_of_empty_objects_are_refused_before_parsing(server: RouterProcess) -> None:
    body = b'{"inputs": [' + b"{}," * (20 * MB // 3 - 8) + b"{}]}"
    before = server.rss()
    replies: list[httpx.Response] = []
    senders = [threading.Thread(target=lambda: replies.append(infer(server, body))) for _ in range(8)]
    with liveness_watched(server) as probes:
        for sender in senders:
            sender.start()
        for sender in senders:
            sender.join()
    assert [r.status_code for r in replies] == [413] * 8, [r.text[:200] for r in replies]
    assert "once parsed" in replies[0].json()["error"]
    assert {probe.status for probe in probes} == {200}
    assert server.rss() - before < 400 * MB  # the bodies themselves, not 27 times them
    still_serving(server)
    flat = json.dumps({"inputs": [{"name": "JSON", "datatype": "BYTES", "shape": [2],
                                   "data": ['{"id": "a"}', '{"id": "b"}']}]}).encode()
    assert infer(server, flat).status_code == 200


# -- V2 odds and ends ----------------------------------------------------------------------------------


def gzip_with_trailing_data(body: bytes) -> tuple[bytes, dict[str, str]]:
    return gzip.compress(body) + b"junk", {**JSON, "content-encoding": "gzip"}


def signed_header_length(body: bytes) -> tuple[bytes, dict[str, str]]:
    return body, {"content-type": "application/octet-stream", "Inference-Header-Content-Length": f"+{len(body)}"}


def a_301_digit_priority(body: bytes) -> tuple[bytes, dict[str, str]]:
    request = json.loads(body)
    request["parameters"] = {"priority": int("9" * 301)}
    return json.dumps(request).encode(), JSON


@pytest.mark.parametrize(("variant", "words"), [
    (gzip_with_trailing_data, "after the end of its stream"),
    (signed_header_length, "decimal digits"),
    (a_301_digit_priority, "got 99999"),
])
def test_v2_odds_and_ends_are_refused(server: RouterProcess, variant: Callable[[bytes], tuple[bytes, dict[str, str]]],
                                      words: str) -> None:
    body, headers = variant(v2(['{"id": "a"}']))
    refused = infer(server, body, headers)
    assert refused.status_code == 400 and words in refused.json()["error"], refused.text
    assert len(refused.text) < 300
    assert infer(server, gzip.compress(v2(['{"id": "a"}'])), {**JSON, "content-encoding": "gzip"}).status_code == 200
    no_tracebacks(server)


def test_v2_load_refuses_parameters_it_would_ignore(server: RouterProcess) -> None:
    load = httpx.post(server.url + "/v2/repository/models/echo/load", json={"parameters": {"config": "{}"}})
    assert load.status_code == 400 and "not supported" in load.json()["error"], load.text
    assert httpx.post(server.url + "/v2/repository/models/echo/load").status_code == 200


# -- the admin routes and the fleet file --------------------------------------------------------------------


@pytest.mark.parametrize(("body", "media_type"), [
    (b"[" * 100_000, "application/json"),
    (b'{"plugin": "scripted", "options": ' + b'{"a": ' * 5000 + b"1" + b"}" * 5000 + b"}", "application/json"),
    (b"[" * 100_000, "application/yaml"),
    (b"plugin: scripted\noptions:\n  a:\n    " + b"- " * 5000 + b"x\n", "application/yaml"),
    (b"plugin: scripted\noptions: {a: \xff\xfe}\n", "application/yaml"),
], ids=["json-arrays", "json-objects", "yaml-flow", "yaml-block", "yaml-not-utf8"])
def test_nested_or_non_utf8_admin_bodies_are_400(server: RouterProcess, body: bytes, media_type: str) -> None:
    answer = httpx.put(server.url + "/models/added", content=body, headers={"content-type": media_type})
    assert answer.status_code == 400, answer.text
    assert httpx.get(server.url + "/models/added").status_code == 404
    no_tracebacks(server)


@pytest.mark.parametrize("text", [
    b"models:\n  echo: {plugin: scripted, options: {a: " + b"[" * 5000 + b"]" * 5000 + b"}}\n",
    b"models:\n  echo: {plugin: scripted}\n# caf\xe9 in Latin-1\n",
], ids=["nested", "latin-1"])
def test_a_nested_or_non_utf8_fleet_file_is_refused_at_reload(server: RouterProcess, text: bytes) -> None:
    fleet = Path(server.log_path).parent / "fleet.yaml"
    good = fleet.read_bytes()
    fleet.write_bytes(text)
    try:
        answer = httpx.post(server.url + "/admin/reload", timeout=30)
    finally:
        fleet.write_bytes(good)
    assert answer.status_code == 400, answer.text
    assert "levels deep" in answer.json()["detail"] or "not UTF-8" in answer.json()["detail"]
    still_serving(server)
    no_tracebacks(server)


def test_a_put_model_that_cannot_load_is_not_added(server: RouterProcess) -> None:
    answer = httpx.put(server.url + "/models/broken", json={"plugin": "scripted", "options": {"load_error": "corrupt"}},
                       timeout=30)
    assert answer.status_code == 503, answer.text
    assert "was not added" in answer.json()["detail"] and "corrupt" in answer.json()["detail"]
    assert httpx.get(server.url + "/models/broken").status_code == 404
    assert httpx.get(server.url + "/health/ready").status_code == 200  # readiness is not held down by it


def test_a_models_instance_count_is_bounded(server: RouterProcess) -> None:
    many = httpx.put(server.url + "/models/wide", json={"plugin": "scripted", "devices": ["cpu"] * 65}, timeout=60)
    assert many.status_code == 400 and "at most 64" in many.json()["detail"], many.text
    assert httpx.get(server.url + "/models/wide").status_code == 404


def test_a_model_name_cannot_end_with_a_newline(server: RouterProcess) -> None:
    newline = httpx.put(server.url + "/models/echo2%0A", json={"plugin": "scripted"}, timeout=30)
    assert newline.status_code == 400 and "is not valid" in newline.json()["detail"], newline.text
    assert "echo2\n" not in [m["name"] for m in httpx.get(server.url + "/models").json()["models"]]
