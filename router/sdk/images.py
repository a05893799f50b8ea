"""Image decoding shared by every vision plugin: one place that turns untrusted bytes into pixels.

`decode_image` returns an RGB, HWC, uint8, C-contiguous numpy array. RGB is what the networks
want; YOLO's letterbox is channel-agnostic, so nobody needs BGR.

The format is sniffed from the bytes (the declared media type may be generic), the pixel count
is checked from the header before anything is decoded, and every failure is a RouterError with
a message a client can act on.

Files are opened through Pillow's format registry (`Image.OPEN`), not `Image.open`: importing
ultralytics replaces `Image.open` process-wide with a wrapper that, on an unidentifiable file,
tries to pip-install pi-heif. An upload must never trigger that.
"""

from __future__ import annotations

import io
import struct
from typing import Final

import numpy as np
from PIL import BmpImagePlugin, Image, ImageOps, JpegImagePlugin, PngImagePlugin, WebPImagePlugin

from router.errors import InputError, PayloadTooLarge, UnsupportedMediaType
from router.sdk.plugin import Payload

__all__ = [
    "ACCEPTED_MEDIA_TYPES",
    "DEFAULT_MAX_PIXELS",
    "decode_image",
    "example_jpeg",
    "image_size",
]

#: Pillow format names we decode, with their display names. Importing the four plugin modules
#: registers them in Image.OPEN.
_FORMATS: Final = {"JPEG": "JPEG", "PNG": "PNG", "WEBP": "WebP", "BMP": "BMP"}
_PLUGINS: Final = (JpegImagePlugin, PngImagePlugin, WebPImagePlugin, BmpImagePlugin)
_IMAGE_MEDIA_TYPES: Final = (
    "image/jpeg",
    "image/jpg",
    "image/pjpeg",
    "image/png",
    "image/webp",
    "image/bmp",
    "image/x-bmp",
    "image/x-ms-bmp",
)
#: Generic types: the bytes decide. An empty media type counts as generic.
_GENERIC_MEDIA_TYPES: Final = ("application/octet-stream", "image/*", "")
#: What a plugin that uses `decode_image` can declare in `accepts`.
ACCEPTED_MEDIA_TYPES: Final[tuple[str, ...]] = (*_IMAGE_MEDIA_TYPES, "application/octet-stream")
#: 40 megapixels (e.g. 8000x5000), below Pillow's own 89 MP warning threshold.
DEFAULT_MAX_PIXELS: Final = 40_000_000
#: What a damaged file raises inside Pillow, depending on where the damage is.
_DECODE_ERRORS: Final = (OSError, SyntaxError, ValueError, EOFError, IndexError, TypeError, KeyError, struct.error)
_ACCEPTED_TEXT: Final = (
    "accepted: JPEG, PNG, WebP, BMP (image/jpeg, image/png, image/webp, image/bmp or application/octet-stream)"
)


def decode_image(payload: Payload, *, max_pixels: int = DEFAULT_MAX_PIXELS) -> np.ndarray:
    """Decode one payload to an RGB uint8 array of shape (height, width, 3), EXIF orientation applied.

    Raises InputError (empty, corrupt, truncated), PayloadTooLarge (over `max_pixels`, checked from
    the header before decoding) or UnsupportedMediaType (declared type or real format not accepted).
    """
    _check_media_type(payload.media_type)
    if not payload.body:
        raise InputError("empty image: the request body has no bytes")
    image = _open_header(payload.body, max_pixels)
    try:
        image.load()
        image = ImageOps.exif_transpose(image)
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:  # defensive: Pillow's own check
        raise PayloadTooLarge(f"image too large: {exc}") from None
    except _DECODE_ERRORS as exc:
        raise InputError(f"corrupt or truncated image data: {exc}") from None
    return _to_rgb_array(image)


def image_size(body: bytes) -> tuple[int, int] | None:
    """(width, height) from an accepted image's header, without decoding it; None if unreadable."""
    fmt = next((f for f in _FORMATS if _accepts(f, body[:16])), None)
    if fmt is None:
        return None
    try:
        width, height = Image.OPEN[fmt][0](io.BytesIO(body), "").size
    except _DECODE_ERRORS:
        return None
    return int(width), int(height)


def _check_media_type(media_type: str) -> None:
    """Refuse a declared type we can never decode, before reading the body."""
    essence = media_type.split(";", 1)[0].strip().lower()
    if essence in _IMAGE_MEDIA_TYPES or essence in _GENERIC_MEDIA_TYPES:
        return
    raise UnsupportedMediaType(f"unsupported media type {media_type!r}; {_ACCEPTED_TEXT}")


def _open_header(body: bytes, max_pixels: int) -> Image.Image:
    """Identify the format and read only the header; enforce the pixel limit before any decode."""
    prefix = body[:16]
    fmt = next((f for f in _FORMATS if _accepts(f, prefix)), None)
    if fmt is None:
        other = _other_format(body)
        if other is not None:
            raise UnsupportedMediaType(f"{other} images are not supported; {_ACCEPTED_TEXT}")
        raise InputError(
            "corrupt or truncated image data: the bytes are not a recognisable JPEG, PNG, WebP or BMP image"
        )
    factory = Image.OPEN[fmt][0]
    try:
        image = factory(io.BytesIO(body), "")  # parses the header; pixels are decoded by load()
    except _DECODE_ERRORS as exc:
        raise InputError(f"corrupt or truncated image data: unreadable {_FORMATS[fmt]} header ({exc})") from None
    width, height = image.size
    if width <= 0 or height <= 0:
        raise InputError(f"corrupt or truncated image data: the {_FORMATS[fmt]} header says {width}x{height}")
    limit, whose = _pixel_limit(max_pixels)
    if width * height > limit:
        size = f"{width}x{height} = {width * height} pixels"
        raise PayloadTooLarge(f"image is {size}; the limit is {limit} pixels{whose}")
    return image


def _accepts(fmt: str, prefix: bytes) -> bool:
    """Whether the format's magic-byte check passes; a str answer (Pillow's "almost") is a no."""
    accept = Image.OPEN[fmt][1]
    try:
        return accept is not None and accept(prefix) is True
    except Exception:  # some checks unpack fixed-size fields and fail on a short prefix
        return False


def _pixel_limit(max_pixels: int) -> tuple[int, str]:
    """The limit that applies: ours, or Pillow's process-wide bomb limit where that is stricter."""
    pillow = Image.MAX_IMAGE_PIXELS
    if pillow is not None and 2 * pillow < max_pixels:
        return 2 * pillow, " (Pillow's decompression-bomb limit, 2 x PIL.Image.MAX_IMAGE_PIXELS)"
    return max_pixels, ""


def _other_format(body: bytes) -> str | None:
    """The name of an image format Pillow knows but we do not accept (GIF, TIFF, ...), else None."""
    Image.init()  # registers every format Pillow has
    for fmt in Image.ID:
        if fmt in _FORMATS or not _accepts(fmt, body[:16]):
            continue
        try:
            Image.OPEN[fmt][0](io.BytesIO(body), "")  # header only; confirms the magic bytes
        except Exception:  # not that format after all
            continue
        return fmt
    return None


def _to_rgb_array(image: Image.Image) -> np.ndarray:
    """Three 8-bit channels whatever the mode: grey, palette, RGBA, CMYK, 16-bit grey."""
    if image.mode in ("I;16", "I;16B", "I;16L", "I"):
        # Pillow's I -> RGB conversion clips at 255; scale 16-bit grey to 8 bits instead.
        grey = np.asarray(image, dtype=np.uint32)
        shift = 8 if image.mode.startswith("I;16") or grey.max(initial=0) > 255 else 0
        grey8 = (grey >> shift).astype(np.uint8)
        return np.ascontiguousarray(np.repeat(grey8[:, :, None], 3, axis=2))
    if image.mode != "RGB":
        image = image.convert("RGB")
    return np.asarray(image, dtype=np.uint8).copy()


def example_jpeg(width: int = 320, height: int = 240, *, seed: int = 0) -> Payload:
    """A small generated JPEG (smooth colours and a few rectangles) for warm-up and profiling."""
    rng = np.random.default_rng(seed)
    ys, xs = np.mgrid[0:height, 0:width]
    red, green = xs * 255 // max(width - 1, 1), ys * 255 // max(height - 1, 1)
    pixels = np.stack([red, green, (red + green) // 2], axis=2).astype(np.uint8)
    for _ in range(3):
        x0, y0 = int(rng.integers(0, width // 2)), int(rng.integers(0, height // 2))
        x1, y1 = x0 + int(rng.integers(8, width // 2)), y0 + int(rng.integers(8, height // 2))
        pixels[y0:y1, x0:x1] = rng.integers(0, 256, 3, dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels, "RGB").save(buffer, format="JPEG", quality=90)
    return Payload(body=buffer.getvalue(), media_type="image/jpeg", filename="example.jpg")
