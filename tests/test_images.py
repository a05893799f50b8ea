"""router.sdk.images: every way an uploaded image can be good or bad, and the status a client sees."""

from __future__ import annotations

import io
import struct
import warnings
import zlib

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image

from router.errors import InputError, PayloadTooLarge, RouterError, UnsupportedMediaType
from router.sdk import images
from router.sdk.images import (
    ACCEPTED_MEDIA_TYPES,
    ImageHeader,
    decode_image,
    example_jpeg,
    open_image,
    reduction_for,
)
from router.sdk.plugin import Payload

EXIF_ORIENTATION = 0x0112


def encode(image: Image.Image, fmt: str, **save: object) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt, **save)
    return buffer.getvalue()


def photo(width: int = 64, height: int = 48, seed: int = 0) -> np.ndarray:
    """A deterministic RGB test picture: gradients plus a block, so channel order and orientation show."""
    rng = np.random.default_rng(seed)
    ys, xs = np.mgrid[0:height, 0:width]
    pixels = np.stack([xs * 255 // width, ys * 255 // height, np.full_like(xs, 90)], axis=2).astype(np.uint8)
    pixels[: height // 3, : width // 3] = rng.integers(0, 256, 3, dtype=np.uint8)
    return pixels


def png_header(width: int, height: int) -> bytes:
    """A PNG whose header claims width x height but holds almost no data: built without allocating the image."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b"")


def bmp_header(width: int, height: int) -> bytes:
    """A 24-bit BMP whose header claims width x height, followed by a few bytes of pixels."""
    info = struct.pack("<IiiHHIIiiII", 40, width, height, 1, 24, 0, 0, 2835, 2835, 0, 0)
    head = b"BM" + struct.pack("<IHHI", 14 + 40 + 64, 0, 0, 14 + 40)
    return head + info + b"\0" * 64


# --- accepted images ---------------------------------------------------------------------------


@pytest.mark.parametrize("fmt, media_type, save", [
    ("PNG", "image/png", {}),
    ("BMP", "image/bmp", {}),
    ("WEBP", "image/webp", {"lossless": True}),
])
def test_lossless_formats_decode_to_the_exact_rgb_pixels(fmt: str, media_type: str, save: dict[str, object]) -> None:
    pixels = photo()
    decoded = decode_image(Payload(encode(Image.fromarray(pixels), fmt, **save), media_type))
    assert decoded.dtype == np.uint8 and decoded.shape == (48, 64, 3) and decoded.flags.c_contiguous
    np.testing.assert_array_equal(decoded, pixels)  # RGB order, not BGR


def test_jpeg_decodes_close_to_the_original_in_rgb_order() -> None:
    pixels = photo()
    decoded = decode_image(Payload(encode(Image.fromarray(pixels), "JPEG", quality=95), "image/jpeg"))
    assert decoded.shape == pixels.shape
    assert np.abs(decoded.astype(int) - pixels).mean() < 3


@pytest.mark.parametrize("media_type", ["application/octet-stream", "", "image/jpeg; charset=binary", "IMAGE/PNG"])
def test_format_is_sniffed_from_the_bytes_whatever_the_generic_or_wrong_label(media_type: str) -> None:
    body = encode(Image.fromarray(photo()), "PNG")
    np.testing.assert_array_equal(decode_image(Payload(body, media_type)), photo())


@pytest.mark.parametrize("mode", ["L", "LA", "RGBA", "P", "1", "CMYK"])
def test_grayscale_alpha_palette_and_cmyk_become_three_channels(mode: str) -> None:
    body = encode(Image.fromarray(photo()).convert(mode), "JPEG" if mode == "CMYK" else "PNG")
    decoded = decode_image(Payload(body, "application/octet-stream"))
    assert decoded.shape == (48, 64, 3) and decoded.dtype == np.uint8
    np.testing.assert_array_equal(decoded, np.asarray(Image.open(io.BytesIO(body)).convert("RGB")))


def test_rgba_keeps_the_colour_and_drops_alpha() -> None:
    rgba = np.zeros((10, 10, 4), np.uint8)
    rgba[..., :3] = (200, 100, 50)
    rgba[..., 3] = 0  # fully transparent still has a colour underneath
    decoded = decode_image(Payload(encode(Image.fromarray(rgba, "RGBA"), "PNG"), "image/png"))
    assert decoded.shape == (10, 10, 3) and tuple(decoded[0, 0]) == (200, 100, 50)


def test_sixteen_bit_grayscale_is_scaled_not_clipped() -> None:
    grey = np.array([[0, 256 * 100, 65535]], dtype=np.uint16)
    decoded = decode_image(Payload(encode(Image.fromarray(grey), "PNG"), "image/png"))
    assert decoded[0, :, 0].tolist() == [0, 100, 255]


@pytest.mark.parametrize("orientation, rotate", [(1, 0), (3, 2), (6, -1), (8, 1)])
def test_exif_orientation_is_honoured(orientation: int, rotate: int) -> None:
    pixels = photo(64, 48)
    exif = Image.Exif()
    exif[EXIF_ORIENTATION] = orientation
    body = encode(Image.fromarray(pixels), "PNG", exif=exif)
    decoded = decode_image(Payload(body, "image/png"))
    np.testing.assert_array_equal(decoded, np.rot90(pixels, rotate))  # rot90 k>0 is counter-clockwise


def test_exif_orientation_is_honoured_for_jpeg() -> None:
    exif = Image.Exif()
    exif[EXIF_ORIENTATION] = 6  # camera held sideways: display rotated 90 degrees clockwise
    body = encode(Image.fromarray(photo(64, 48)), "JPEG", quality=95, exif=exif)
    decoded = decode_image(Payload(body, "image/jpeg"))
    assert decoded.shape == (64, 48, 3)
    assert np.abs(decoded.astype(int) - np.rot90(photo(64, 48), -1)).mean() < 3


def test_example_jpeg_is_a_valid_small_jpeg() -> None:
    payload = example_jpeg()
    assert payload.media_type == "image/jpeg" and payload.body[:3] == b"\xff\xd8\xff"
    assert decode_image(payload).shape == (240, 320, 3)


def test_accepted_media_types_cover_the_four_formats_and_octet_stream() -> None:
    for media_type in ("image/jpeg", "image/png", "image/webp", "image/bmp", "application/octet-stream"):
        assert media_type in ACCEPTED_MEDIA_TYPES


# --- bad input: 400 ----------------------------------------------------------------------------


def test_empty_body_is_a_400_that_says_empty() -> None:
    with pytest.raises(InputError, match="empty image") as caught:
        decode_image(Payload(b"", "image/jpeg"))
    assert caught.value.status_code == 400


@pytest.mark.parametrize("body", [
    b"this is not an image at all",
    bytes(range(256)) * 4,
    b"\xff\xd8",  # a JPEG start marker and nothing else
    b"\x89PNG\r\n\x1a\n",  # a PNG signature and nothing else
])
def test_corrupt_bytes_are_a_400_that_says_corrupt(body: bytes) -> None:
    with pytest.raises(InputError, match="corrupt or truncated image data") as caught:
        decode_image(Payload(body, "image/jpeg"))
    assert type(caught.value) is InputError and caught.value.status_code == 400


@pytest.mark.parametrize("fmt", ["JPEG", "PNG", "WEBP", "BMP"])
@pytest.mark.parametrize("keep", [0.3, 0.6, 0.95])
def test_truncated_images_are_a_400_that_says_truncated(fmt: str, keep: float) -> None:
    noise = np.random.default_rng(1).integers(0, 256, (96, 128, 3), dtype=np.uint8)  # incompressible
    body = encode(Image.fromarray(noise), fmt)
    with pytest.raises(InputError, match="corrupt or truncated image data") as caught:
        decode_image(Payload(body[: int(len(body) * keep)], "application/octet-stream"))
    assert caught.value.status_code == 400


def test_valid_header_with_garbage_data_is_a_400() -> None:
    body = encode(Image.fromarray(photo()), "PNG")
    damaged = body[:60] + bytes(len(body) - 60)
    with pytest.raises(InputError, match="corrupt or truncated image data") as caught:
        decode_image(Payload(damaged, "image/png"))
    assert caught.value.status_code == 400


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(body=st.binary(max_size=600), cut=st.integers(0, 5000), flip=st.integers(0, 5000))
def test_arbitrary_or_damaged_bytes_only_ever_raise_router_errors(body: bytes, cut: int, flip: int) -> None:
    png = bytearray(encode(Image.fromarray(photo(32, 24)), "PNG"))
    png[flip % len(png)] ^= 0xFF
    for candidate in (body, bytes(png[: cut % len(png)]), bytes(png)):
        try:
            decoded = decode_image(Payload(candidate, "application/octet-stream"))
        except RouterError as exc:
            assert exc.status_code in (400, 413, 415) and exc.detail
        else:
            assert decoded.ndim == 3 and decoded.shape[2] == 3


# --- too large: 413, decided from the header ---------------------------------------------------


def test_bomb_header_is_a_413_with_size_and_limit() -> None:
    # 100000 x 100000 would be 30 GB decoded.
    with pytest.raises(PayloadTooLarge) as caught:
        decode_image(Payload(png_header(100_000, 100_000), "image/png"))
    assert caught.value.status_code == 413
    assert caught.value.detail == "image is 100000x100000 = 10000000000 pixels; the limit is 40000000 pixels"


def test_header_over_our_limit_is_refused_before_decoding() -> None:
    # 50 MP is under Pillow's limits, so only our header check stands between it and a decode; the
    # body holds almost no pixel data, so a decode would have failed as "truncated" (400), not 413.
    with pytest.raises(PayloadTooLarge, match=r"10000x5000 = 50000000 pixels; the limit is 40000000 pixels") as caught:
        decode_image(Payload(png_header(10_000, 5_000), "image/png"))
    assert caught.value.status_code == 413


@pytest.mark.parametrize("width, height, message", [
    (8_000, 6_000, "8000x6000 = 48000000 pixels; the limit is 40000000 pixels"),
    (30_000, 30_000, "30000x30000 = 900000000 pixels; the limit is 40000000 pixels"),
])
def test_bmp_bomb_header_is_a_413(width: int, height: int, message: str) -> None:
    with pytest.raises(PayloadTooLarge, match=message):
        decode_image(Payload(bmp_header(width, height), "application/octet-stream"))


def test_a_limit_above_pillows_own_names_the_limit_that_applied() -> None:
    with pytest.raises(PayloadTooLarge) as caught:
        decode_image(Payload(bmp_header(30_000, 30_000), "image/bmp"), max_pixels=4_000_000_000)
    limit = 2 * Image.MAX_IMAGE_PIXELS
    assert caught.value.detail == (
        f"image is 30000x30000 = 900000000 pixels; the limit is {limit} pixels "
        "(Pillow's decompression-bomb limit, 2 x PIL.Image.MAX_IMAGE_PIXELS)"
    )


def test_pillow_bomb_warning_cannot_preempt_our_413() -> None:
    # 100 MP is past Pillow's warning threshold; a `-W error` filter would turn that warning into an exception.
    with warnings.catch_warnings():
        warnings.simplefilter("error", Image.DecompressionBombWarning)
        message = r"^image is 10000x10000 = 100000000 pixels; the limit is 40000000 pixels$"
        with pytest.raises(PayloadTooLarge, match=message):
            decode_image(Payload(png_header(10_000, 10_000), "image/png"))


def test_custom_pixel_limit_applies_to_real_images() -> None:
    body = encode(Image.fromarray(photo(64, 48)), "PNG")
    with pytest.raises(PayloadTooLarge, match="64x48 = 3072 pixels; the limit is 3000 pixels"):
        decode_image(Payload(body, "image/png"), max_pixels=3000)
    assert decode_image(Payload(body, "image/png"), max_pixels=3072).shape == (48, 64, 3)


# --- unsupported: 415 --------------------------------------------------------------------------


@pytest.mark.parametrize("media_type", ["image/gif", "text/plain", "application/json", "image/tiff"])
def test_declared_unsupported_media_type_is_a_415_naming_accepted_types(media_type: str) -> None:
    body = encode(Image.fromarray(photo()), "PNG")  # the declared type alone decides
    with pytest.raises(UnsupportedMediaType) as caught:
        decode_image(Payload(body, media_type))
    assert caught.value.status_code == 415
    assert repr(media_type) in caught.value.detail
    assert "accepted: JPEG, PNG, WebP, BMP" in caught.value.detail and "image/jpeg" in caught.value.detail


@pytest.mark.parametrize("fmt, name", [("GIF", "GIF"), ("TIFF", "TIFF"), ("ICO", "ICO")])
def test_unsupported_format_behind_a_generic_or_wrong_type_is_a_415_naming_it(fmt: str, name: str) -> None:
    body = encode(Image.fromarray(photo(32, 32)), fmt)
    for media_type in ("application/octet-stream", "image/jpeg"):
        message = f"{name} images are not supported; accepted: JPEG, PNG, WebP, BMP"
        with pytest.raises(UnsupportedMediaType, match=message):
            decode_image(Payload(body, media_type))


def test_image_size_reads_only_the_header() -> None:
    from router.sdk.images import image_size

    assert image_size(png_header(100_000, 50_000)) == (100_000, 50_000)  # never decoded: 15 GB of pixels
    assert image_size(b"not an image") is None


# --- the fast path: libjpeg-turbo (or OpenCV) for JPEG, orientation, DCT reduction, channel order --


@pytest.fixture(params=["simplejpeg", "opencv"])
def jpeg_decoder(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Each JPEG decoder in turn: simplejpeg, and OpenCV as where simplejpeg is not installed."""
    if request.param == "opencv":
        monkeypatch.setattr(images, "_simplejpeg", lambda: None)
    return str(request.param)


@pytest.mark.parametrize("orientation", range(1, 9))
def test_every_exif_orientation_of_a_jpeg_matches_pillows_transpose(orientation: int, jpeg_decoder: str) -> None:
    from PIL import ImageOps

    exif = Image.Exif()
    exif[EXIF_ORIENTATION] = orientation
    body = encode(Image.fromarray(photo(64, 48)), "JPEG", quality=95, exif=exif)
    expected = np.asarray(ImageOps.exif_transpose(Image.open(io.BytesIO(body))).convert("RGB"))
    opened = open_image(Payload(body, "image/jpeg"))
    assert (opened.header.width, opened.header.height) == (expected.shape[1], expected.shape[0])
    np.testing.assert_array_equal(opened.decode(), expected)


@pytest.mark.parametrize("mode", ["RGB", "L"])
def test_the_jpeg_decoders_and_pillow_decode_a_jpeg_to_the_same_pixels(mode: str, jpeg_decoder: str) -> None:
    body = encode(Image.fromarray(photo(97, 61)).convert(mode), "JPEG", quality=90)
    expected = np.asarray(Image.open(io.BytesIO(body)).convert("RGB"))
    np.testing.assert_array_equal(decode_image(Payload(body, "image/jpeg")), expected)
    np.testing.assert_array_equal(open_image(Payload(body, "image/jpeg")).decode(channels="BGR"), expected[:, :, ::-1])


@pytest.mark.parametrize("reduce", [2, 4, 8])
def test_a_reduced_jpeg_decode_has_the_sides_rounded_up_and_png_ignores_it(reduce: int, jpeg_decoder: str) -> None:
    jpeg = open_image(Payload(encode(Image.fromarray(photo(203, 101)), "JPEG"), "image/jpeg"))
    assert jpeg.decode(reduce=reduce).shape == (-(-101 // reduce), -(-203 // reduce), 3)
    png = open_image(Payload(encode(Image.fromarray(photo(203, 101)), "PNG"), "image/png"))
    assert png.decode(reduce=reduce).shape == (101, 203, 3)
    with pytest.raises(ValueError, match="reduce must be 1, 2, 4 or 8, got 3"):
        jpeg.decode(reduce=3)


@pytest.mark.parametrize("size, short, long, expected", [
    ((4032, 3024), 256, 256, 8), ((4032, 3024), 640, 640, 4), ((810, 1080), 256, 256, 2),
    ((810, 1080), 1, 640, 1), ((300, 200), 256, 256, 1),
])
def test_reduction_keeps_the_image_at_least_the_target(
    size: tuple[int, int], short: int, long: int, expected: int
) -> None:
    header = ImageHeader("JPEG", size[0], size[1], 1, "RGB")
    assert reduction_for(header, short, long) == expected
    assert reduction_for(ImageHeader("PNG", size[0], size[1], 1, "RGB"), short, long) == 1


@pytest.mark.parametrize("width, height", [(1, 4000), (4000, 1), (16383, 2), (1, 21), (2, 1000)])
def test_images_more_elongated_than_the_limit_are_400_from_the_header(width: int, height: int) -> None:
    short, long = sorted((width, height))
    with pytest.raises(InputError, match=rf"image is {width}x{height}, an aspect ratio of .*; the limit is 20:1") as caught:
        decode_image(Payload(png_header(width, height), "image/png"))
    assert caught.value.status_code == 400 and long > 20 * short


def test_the_aspect_ratio_limit_is_a_setting_and_allows_up_to_it() -> None:
    body = encode(Image.fromarray(photo(200, 10)), "PNG")
    assert decode_image(Payload(body, "image/png")).shape == (10, 200, 3)
    with pytest.raises(InputError, match="the limit is 10:1"):
        decode_image(Payload(body, "image/png"), max_aspect_ratio=10)


def test_the_header_reports_size_as_displayed_and_decoded_bytes() -> None:
    exif = Image.Exif()
    exif[EXIF_ORIENTATION] = 6
    header = open_image(Payload(encode(Image.fromarray(photo(64, 48)), "JPEG", exif=exif), "image/jpeg")).header
    assert (header.format, header.width, header.height, header.orientation) == ("JPEG", 48, 64, 6)
    assert header.decoded_bytes == 3 * 64 * 48
