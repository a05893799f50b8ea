"""Images whose cost is out of proportion to their bytes, against a real server (issue 15, item 1).

A 97-byte 1x4000 PNG once made the ResNet preprocessing allocate a 3x256x1,024,000 float tensor.
Here such images (PNG and WebP, 1xN and Nx1, and the same shape as a V2 UINT8 tensor) go to both
vision models of a server whose address space is capped (RLIMIT_AS, set once it is ready), so a
regression fails this test instead of the machine: each is answered 4xx from its header, the
server's RSS rises by less than 100 MB, and a normal photo sent meanwhile is served.
"""

from __future__ import annotations

import io
import resource
import threading
from collections.abc import Iterator

import httpx
import psutil
import pytest
from PIL import Image

from router.store import init_demo
from tests.conftest import HANG_S, RouterProcess, serve

pytestmark = pytest.mark.e2e

FLEET = """
model_store: {store}
models:
  resnet18:
    plugin: resnet
    options: {{weights: resnet18.pt}}
  yolov8n:
    plugin: yolo
    options: {{model: yolov8n.pt, imgsz: 320}}
"""
HEADROOM = 1536 * 2**20  # address space allowed above the ready server's


def encoded(width: int, height: int, fmt: str) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (width, height), (90, 120, 200)).save(buffer, format=fmt, **({"lossless": True} if fmt == "WEBP" else {}))
    return buffer.getvalue()


ELONGATED = [(1, 4000, "PNG"), (4000, 1, "PNG"), (1, 16000, "PNG"), (16383, 2, "WEBP"), (2, 16383, "WEBP")]
BODIES = [(f"{width}x{height} {fmt}", fmt, encoded(width, height, fmt)) for width, height, fmt in ELONGATED]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RouterProcess]:
    store = tmp_path_factory.mktemp("store")
    init_demo(store, progress=lambda line: None)
    with serve(tmp_path_factory.mktemp("bounds"), FLEET.format(store=store)) as process:
        pid = process.process.pid
        limit = psutil.Process(pid).memory_info().vms + HEADROOM
        resource.prlimit(pid, resource.RLIMIT_AS, (limit, limit))
        yield process


class PeakRss(threading.Thread):
    def __init__(self, pid: int) -> None:
        super().__init__(daemon=True)
        self.process = psutil.Process(pid)
        self.start_rss = self.peak = self.process.memory_info().rss
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.wait(0.01):
            self.peak = max(self.peak, self.process.memory_info().rss)

    def rise(self) -> int:
        self.done.set()
        self.join(1)
        return self.peak - self.start_rss


def photo(server: RouterProcess, model: str, results: list[int]) -> None:
    body = encoded(640, 480, "JPEG")
    results.append(httpx.post(f"{server.url}/models/{model}/predict", content=body,
                              headers={"content-type": "image/jpeg"}, timeout=30).status_code)


@pytest.mark.parametrize("model", ["resnet18", "yolov8n"])
def test_elongated_images_are_refused_from_the_header_with_bounded_memory(server: RouterProcess, model: str) -> None:
    photo(server, model, [])  # warm: first requests pay for lazy imports
    watch = PeakRss(server.process.pid)
    watch.start()
    normal: list[int] = []
    meanwhile = threading.Thread(target=photo, args=(server, model, normal))
    meanwhile.start()
    with httpx.Client(base_url=server.url, timeout=HANG_S) as client:
        for _ in range(3):
            for name, fmt, body in BODIES:
                response = client.post(f"/models/{model}/predict", content=body,
                                       headers={"content-type": f"image/{fmt.lower()}"})
                assert response.status_code == 400 and len(body) < 200, (name, len(body), response.text)
                assert "aspect ratio" in response.json()["detail"]
    meanwhile.join(30)
    rise = watch.rise()
    assert rise < 100 * 2**20, f"RSS rose by {rise >> 20} MB"  # refused from the header: no pixel was decoded
    assert normal == [200]
    assert server.process.poll() is None


def test_the_same_shape_as_a_v2_pixel_tensor_is_refused(server: RouterProcess) -> None:
    request = {"inputs": [{"name": "IMAGE", "shape": [1, 1, 1000, 3], "datatype": "UINT8", "data": [7] * 3000}]}
    for model in ("resnet18", "yolov8n"):
        response = httpx.post(f"{server.url}/v2/models/{model}/infer", json=request, timeout=HANG_S)
        assert response.status_code == 400 and "aspect ratio" in response.json()["error"], response.text
    assert server.process.poll() is None


def test_a_normal_v2_pixel_tensor_is_served(server: RouterProcess) -> None:
    request = {"inputs": [{"name": "IMAGE", "shape": [1, 32, 48, 3], "datatype": "UINT8", "data": [7] * (32 * 48 * 3)}]}
    assert httpx.post(f"{server.url}/v2/models/resnet18/infer", json=request, timeout=30).status_code == 200
