"""A fuzz pass over the image decoders and both vision preprocessings (issue 15).

Random bytes, real JPEG/PNG/WebP/BMP files with their headers mutated, and headers claiming
random dimensions go through `decode_image` and the ResNet and YOLO preprocessing. Every
outcome is a success or an InputError subclass (400, 413, 415), never another exception, and
no example allocates (numpy, as tracemalloc sees it) more than its pixel limit allows.
"""

from __future__ import annotations

import io
import struct
import tracemalloc
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image

from router.errors import InputError
from router.sdk.images import decode_image
from router.sdk.plugin import Payload
from tests.test_images import bmp_header, png_header

MAX_PIXELS = 2_000_000  # small, so that the memory bound below means something
PEAK_LIMIT = 48 * 2**20  # decode (6 MB), Pillow's own buffer (8 MB), resize and copies, with room
FUZZ = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def _real(fmt: str) -> bytes:
    rng = np.random.default_rng(7)
    pixels = rng.integers(0, 256, (40, 56, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format=fmt, **({"lossless": True} if fmt == "WEBP" else {}))
    return buffer.getvalue()


REAL = {fmt: _real(fmt) for fmt in ("JPEG", "PNG", "WEBP", "BMP")}


def _preprocessors() -> list[Callable[[Payload], Any]]:
    from model_router_resnet.processing import ClassifyProcessing
    from model_router_yolo.processing import DetectSettings, YoloProcessing

    yolo = YoloProcessing(320, 32, [str(i) for i in range(80)], DetectSettings(), MAX_PIXELS)
    return [
        lambda payload: decode_image(payload, max_pixels=MAX_PIXELS),
        ClassifyProcessing(max_pixels=MAX_PIXELS).preprocess,
        ClassifyProcessing(max_pixels=MAX_PIXELS, decode_mode="fast").preprocess,
        yolo.preprocess,
    ]


PREPROCESSORS = _preprocessors()


def jpeg_with_size(width: int, height: int) -> bytes:
    """The real JPEG with its SOF0 frame header rewritten to claim width x height."""
    body = bytearray(REAL["JPEG"])
    sof = body.find(b"\xff\xc0")
    body[sof + 5 : sof + 9] = struct.pack(">HH", height, width)
    return bytes(body)


def check(body: bytes) -> None:
    """Every preprocessing: success or a client error, and a bounded peak allocation."""
    for preprocess in PREPROCESSORS:
        tracemalloc.start()
        try:
            preprocess(Payload(body, "application/octet-stream"))
        except InputError as exc:
            assert 400 <= exc.status_code < 500 and exc.detail
        finally:
            _, peak = tracemalloc.get_traced_memory()
            tracemalloc.stop()
        assert peak < PEAK_LIMIT, f"{peak} bytes allocated for a {len(body)}-byte input"


@FUZZ
@given(body=st.binary(max_size=2048))
def test_random_bytes(body: bytes) -> None:
    check(body)


@FUZZ
@given(fmt=st.sampled_from(sorted(REAL)), edits=st.lists(st.tuples(st.integers(0, 200), st.integers(0, 255)),
                                                         min_size=1, max_size=8), cut=st.integers(0, 4000))
def test_real_files_with_mutated_headers(fmt: str, edits: list[tuple[int, int]], cut: int) -> None:
    body = bytearray(REAL[fmt])
    for offset, value in edits:
        body[offset % len(body)] = value
    check(bytes(body))
    check(bytes(body[: max(1, cut % len(body))]))


@FUZZ
@given(kind=st.sampled_from(["png", "bmp", "jpeg"]), width=st.integers(1, 65535), height=st.integers(1, 65535))
def test_headers_claiming_random_dimensions(kind: str, width: int, height: int) -> None:
    body = {"png": png_header, "bmp": bmp_header, "jpeg": jpeg_with_size}[kind](width, height)
    check(body)


@pytest.mark.parametrize("fmt", sorted(REAL))
def test_the_unmutated_files_decode(fmt: str) -> None:
    for preprocess in PREPROCESSORS:
        preprocess(Payload(REAL[fmt], "application/octet-stream"))
