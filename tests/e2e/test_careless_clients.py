"""Careless clients against a real server: multipart parts without a Content-Type, clients that
leave mid-upload or mid-inference, unrouted paths and wrong methods, odd header values and very
long names. None is a server error, each is logged once as what it was, with its request id."""

from __future__ import annotations

import time
from collections.abc import Iterator

import httpx
import pytest

from tests.conftest import RouterProcess, serve

pytestmark = pytest.mark.e2e

FLEET = """
models:
  echo:
    plugin: scripted
    batch: {max_size: 4, max_delay_ms: 2}
  slow:
    plugin: scripted
    options: {fixed_ms: 1500}
    batch: {max_size: 1, max_delay_ms: 0}
    warmup: {enabled: false}
"""


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RouterProcess]:
    with serve(tmp_path_factory.mktemp("careless"), FLEET) as process:
        yield process


def test_a_multipart_file_part_without_content_type_is_sniffed_not_refused(server: RouterProcess) -> None:
    """Python requests' `files={"file": open(...)}` sends the part with a filename and no Content-Type."""
    body = (b"--b0undary\r\nContent-Disposition: form-data; name=\"file\"; filename=\"input.bin\"\r\n\r\n"
            b"plain bytes\r\n--b0undary--\r\n")
    response = httpx.post(server.url + "/models/echo/predict", content=body,
                          headers={"content-type": "multipart/form-data; boundary=b0undary"}, timeout=10)
    assert response.status_code == 200, response.text
    assert response.json()["result"]["id"] == "plain bytes"


def test_a_thousand_multipart_parts_get_a_sensible_400(server: RouterProcess) -> None:
    parts = b"".join(b"--xyz\r\nContent-Disposition: form-data; name=\"f%d\"\r\n\r\nv\r\n" % i for i in range(1000))
    response = httpx.post(server.url + "/models/echo/predict", content=parts + b"--xyz--\r\n",
                          headers={"content-type": "multipart/form-data; boundary=xyz"}, timeout=10)
    assert response.status_code == 400
    assert response.json()["detail"] == ("the multipart body has more than 16 parts; "
                                         "send the input as one field named 'file'")


def test_a_client_leaving_during_inference_is_499_not_an_error(server: RouterProcess) -> None:
    with server.connect() as sock:
        sock.sendall(b"POST /models/slow/predict HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"X-Request-ID: leaves-early\r\nContent-Length: 11\r\n\r\n{\"id\": \"a\"}")
        server.until_model("slow", lambda m: m["instances"][0]["busy"])  # running, not answered (1.5 s)
    lines = server.access_lines("leaves-early")
    assert [line["status"] for line in lines] == [499]
    assert not [r for r in server.log_records() if r.get("level") == "error"]
    assert "CancelledError" not in server.log() and "Traceback" not in server.log()


def test_a_client_leaving_while_queued_takes_its_input_out_of_the_queue(server: RouterProcess) -> None:
    """The connection tells of its loss: the request waiting behind a busy instance is withdrawn at
    once (the queue empties while the instance is still busy), and logged 499."""
    head = (b"POST /models/slow/predict HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"X-Request-ID: %s\r\nContent-Length: 11\r\n\r\n{\"id\": \"a\"}")
    with server.connect() as first:
        first.sendall(head % b"runs-first")
        server.until_model("slow", lambda m: m["instances"][0]["busy"])
        with server.connect() as queued:
            queued.sendall(head % b"leaves-queued")
            server.until_model("slow", lambda m: m["queue"]["depth"] == 1)
        model = server.until_model("slow", lambda m: m["queue"]["depth"] == 0, timeout=1.0)
        assert model["instances"][0]["busy"]  # withdrawn while the one before it still runs
        assert [line["status"] for line in server.access_lines("leaves-queued")] == [499]
        first.settimeout(10)
        assert first.recv(64).startswith(b"HTTP/1.1 200")


def test_a_client_leaving_mid_upload_is_499_not_500(server: RouterProcess) -> None:
    with server.connect() as sock:
        sock.sendall(b"POST /models/echo/predict HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"X-Request-ID: upload-abandoned\r\nContent-Length: 100000\r\n\r\n" + b" " * 1000)
        time.sleep(0.2)
    lines = server.access_lines("upload-abandoned")
    assert [line["status"] for line in lines] == [499]
    assert not [r for r in server.log_records() if r.get("level") == "error"]


@pytest.mark.parametrize(("method", "path", "status", "shape"), [
    ("GET", "/no/such/route", 404, "detail"),
    ("GET", "/models/echo/predict", 405, "detail"),
    ("POST", "/models/a%2Fb/predict", 404, "detail"),
    ("GET", "/v2/no/such/route", 404, "error"),
    ("DELETE", "/v2/models/echo/infer", 405, "error"),
])
def test_unrouted_requests_carry_a_request_id_and_an_access_line(
    server: RouterProcess, method: str, path: str, status: int, shape: str
) -> None:
    request_id = f"unrouted-{status}-{shape}-{method}-{len(path)}"
    response = httpx.request(method, server.url + path, headers={"X-Request-ID": request_id}, timeout=10)
    assert response.status_code == status
    assert response.headers["x-request-id"] == request_id
    assert shape in response.json()
    assert [line["status"] for line in server.access_lines(request_id)] == [status]


@pytest.mark.parametrize("value", ["1e300", "1_0", "0x1", "9" * 400, "1.0"])
def test_odd_priorities_are_refused_without_echoing_them_in_full(server: RouterProcess, value: str) -> None:
    response = httpx.post(server.url + "/models/echo/predict", json={"id": "p"}, headers={"X-Priority": value}, timeout=10)
    assert response.status_code == 400
    detail = response.json()["detail"]
    assert detail.startswith("X-Priority must be an integer") and len(detail) < 120


def test_long_model_names_and_media_types_are_truncated_in_echoes(server: RouterProcess) -> None:
    long_name = httpx.post(f"{server.url}/models/{'m' * 10_000}/predict", json={"id": "x"}, timeout=10)
    assert long_name.status_code == 404 and len(long_name.json()["detail"]) < 300
    long_type = httpx.post(server.url + "/models/echo/predict", content=b"{}", timeout=10,
                           headers={"content-type": "text/" + "x" * 10_000})
    assert long_type.status_code == 415 and len(long_type.json()["detail"]) < 300
