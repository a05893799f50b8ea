"""Plugin test fixtures: the demo store built once per session, generated photos, and no network."""

from __future__ import annotations

import io
import os
import socket
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pytest
from PIL import Image

from router.config import FleetConfig
from router.sdk.plugin import Payload
from router.serving.plan import FleetPlan, resolve_fleet
from router.serving.registry import PluginRegistry
from router.store import init_demo

if TYPE_CHECKING:
    from model_router_onnx.export import OnnxExport

# The reference calls import ultralytics directly; keep its import-time connectivity probe off too.
os.environ.setdefault("YOLO_OFFLINE", "1")

#: (width, height) of the test images: landscape, portrait, square, tiny, very thin, large.
SIZES = [(320, 240), (480, 640), (517, 333), (96, 96), (1280, 720), (400, 50), (120, 200), (640, 480)]

_LOOPBACK = ("localhost", "127.0.0.1", "::1")


@contextmanager
def network_refused() -> Iterator[list[str]]:
    """DNS lookups and connections to anything but loopback fail inside, and are recorded."""
    attempts: list[str] = []
    real_getaddrinfo, real_connect = socket.getaddrinfo, socket.socket.connect

    def getaddrinfo(host: Any, *args: Any, **kwargs: Any) -> Any:
        if host in _LOOPBACK:
            return real_getaddrinfo(host, *args, **kwargs)
        attempts.append(f"getaddrinfo({host!r})")
        raise OSError("network access is disabled in the plugin tests")

    def connect(sock: socket.socket, address: Any) -> Any:
        if isinstance(address, tuple) and address[0] in _LOOPBACK:
            return real_connect(sock, address)
        attempts.append(f"connect({address!r})")
        raise OSError("network access is disabled in the plugin tests")

    patch = pytest.MonkeyPatch()
    patch.setattr(socket, "getaddrinfo", getaddrinfo)
    patch.setattr(socket.socket, "connect", connect)
    try:
        yield attempts
    finally:
        patch.undo()


@pytest.fixture(scope="module", autouse=True)
def _no_network() -> Iterator[None]:
    """Each plugin test module, its model-loading fixtures included, runs with the network refused."""
    with network_refused() as attempts:
        yield
    assert attempts == [], f"the code under test tried to reach the network: {attempts}"


@pytest.fixture(scope="session")
def demo_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A model store with the demo checkpoints, built once per session with the network refused."""
    store = tmp_path_factory.mktemp("model_store")
    with network_refused() as attempts:
        built = init_demo(store, progress=lambda line: None)
    assert attempts == [], f"init_demo tried to reach the network: {attempts}"
    assert {p.name for p in built} == {"yolov8n.pt", "resnet18.pt", "resnet18-b.pt"}
    return store


@pytest.fixture(scope="session")
def tiny_cnn_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A model store with the tiny-cnn example's checkpoint (examples/plugin-tiny-cnn), written by its own code."""
    from tiny_cnn import save_weights

    store = tmp_path_factory.mktemp("tiny_cnn_store")
    save_weights(store / "tiny-cnn.pt")
    return store


#: The detector the ONNX tests export: a small input and a low threshold, so there are many boxes to compare.
YOLO_EXPORT_OPTIONS: dict[str, Any] = {"model": "yolov8n.pt", "imgsz": 320, "conf": 0.1, "iou": 0.7, "max_det": 3000}


def fleet_plan(store: Path) -> FleetPlan:
    """Both demo models (batches of 8) and a model of a plugin that cannot be exported."""
    fleet = FleetConfig.model_validate({
        "model_store": str(store),
        "models": {
            "yolov8n": {"plugin": "yolo", "options": YOLO_EXPORT_OPTIONS, "batch": {"max_size": 8}},
            "resnet18": {"plugin": "resnet", "options": {"weights": "resnet18.pt"}, "batch": {"max_size": 8}},
            "toy": {"plugin": "toy"},
        },
    })
    return resolve_fleet(fleet, PluginRegistry.from_entry_points(), "test-fleet")


@pytest.fixture(scope="session")
def onnx_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("onnx_store")


@pytest.fixture(scope="session")
def exports(demo_store: Path, onnx_store: Path) -> dict[str, OnnxExport]:
    """Both demo models exported to ONNX by the onnx exporter, once per session."""
    from model_router_onnx.export import export_onnx

    from router.exporting import source_model

    plan = fleet_plan(demo_store)
    lines: list[str] = []
    with network_refused() as attempts:
        result = {name: export_onnx(source_model(plan, name), out=onnx_store / f"{name}.onnx", progress=lines.append)
                  for name in ("yolov8n", "resnet18")}
    assert attempts == [], f"the export tried to reach the network: {attempts}"
    assert any(line.startswith("[2/4]") for line in lines) and any("[4/4]" in line for line in lines)
    return result


def photo(width: int, height: int, seed: int) -> np.ndarray:
    """A deterministic RGB picture: smooth colour field, noise, and a few solid rectangles and discs."""
    rng = np.random.default_rng(seed)
    coarse = rng.integers(0, 256, (6, 8, 3), dtype=np.uint8)
    base = np.asarray(Image.fromarray(coarse).resize((width, height), Image.Resampling.BILINEAR), dtype=np.int16)
    pixels = np.clip(base + rng.integers(-12, 13, base.shape), 0, 255).astype(np.uint8)
    ys, xs = np.mgrid[0:height, 0:width]
    for _ in range(4):
        cx, cy = rng.integers(0, width), rng.integers(0, height)
        rx, ry = rng.integers(4, max(5, width // 3)), rng.integers(4, max(5, height // 3))
        colour = rng.integers(0, 256, 3, dtype=np.uint8)
        if rng.random() < 0.5:
            pixels[max(0, cy - ry) : cy + ry, max(0, cx - rx) : cx + rx] = colour
        else:
            pixels[((xs - cx) / rx) ** 2 + ((ys - cy) / ry) ** 2 <= 1] = colour
    return pixels


def encode(pixels: np.ndarray, fmt: str) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format=fmt, **({"quality": 90} if fmt == "JPEG" else {}))
    return buffer.getvalue()


@pytest.fixture(scope="session")
def payloads() -> list[Payload]:
    """One payload per SIZES entry, alternating JPEG and PNG."""
    result = []
    for index, (width, height) in enumerate(SIZES):
        fmt = "JPEG" if index % 2 == 0 else "PNG"
        result.append(Payload(encode(photo(width, height, seed=index), fmt), f"image/{fmt.lower()}"))
    return result


@pytest.fixture(scope="session")
def make_payload() -> Callable[..., Payload]:
    def make(width: int, height: int, *, seed: int = 0, fmt: str = "JPEG") -> Payload:
        return Payload(encode(photo(width, height, seed), fmt), f"image/{fmt.lower()}")

    return make
