"""Image decoding shared by every vision plugin: one place that turns untrusted bytes into pixels.

`decode_image` returns an RGB, HWC, uint8, C-contiguous numpy array. `open_image` splits that in
two for plugins that plan their work from the header first: it checks the header and returns an
`OpenedImage` whose `decode` can ask for a DCT-domain reduced decode (JPEG at 1/2, 1/4 or 1/8
scale) and for BGR order, which OpenCV decodes without a conversion.

A payload that already carries decoded pixels (`Payload.pixels`: a pipeline's crop, or its input
decoded once by the router) is handed over as it is, under the same limits: nothing is decoded
or encoded again.

The format is sniffed from the bytes (the declared media type may be generic); the pixel count
and the aspect ratio are checked from the header before anything is decoded, so what a decode
allocates is known and bounded first; and every failure is a RouterError with a message a client
can act on. JPEGs in RGB or grey are decoded by OpenCV (libjpeg-turbo) when it is installed, which
is about 3x faster than Pillow's decode and conversion; everything else by Pillow.

Files are opened through Pillow's format registry (`Image.OPEN`), not `Image.open`: importing
ultralytics replaces `Image.open` process-wide with a wrapper that, on an unidentifiable file,
tries to pip-install pi-heif. An upload must never trigger that.
"""

from __future__ import annotations

import io
import struct
from dataclasses import dataclass
from functools import cache
from types import ModuleType
from typing import Final, Literal

import numpy as np
from PIL import BmpImagePlugin, Image, ImageOps, JpegImagePlugin, PngImagePlugin, WebPImagePlugin

from router.errors import InputError, PayloadTooLarge, UnsupportedMediaType
from router.sdk.plugin import Payload

__all__ = [
    "ACCEPTED_MEDIA_TYPES",
    "DEFAULT_MAX_ASPECT_RATIO",
    "DEFAULT_MAX_PIXELS",
    "ImageHeader",
    "OpenedImage",
    "decode_image",
    "example_jpeg",
    "image_size",
    "open_image",
    "reduction_for",
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
#: Long side over short side. Wider than a phone's panorama (about 4:1); a 1x4000 image (97 bytes
#: as a PNG) is refused before a resize by the short side can turn it into gigabytes.
DEFAULT_MAX_ASPECT_RATIO: Final = 20.0
#: What a damaged file raises inside Pillow, depending on where the damage is.
_DECODE_ERRORS: Final = (OSError, SyntaxError, ValueError, EOFError, IndexError, TypeError, KeyError, struct.error)
_ACCEPTED_TEXT: Final = (
    "accepted: JPEG, PNG, WebP, BMP (image/jpeg, image/png, image/webp, image/bmp or application/octet-stream)"
)
_EXIF_ORIENTATION: Final = 0x0112
_REDUCTIONS: Final = (8, 4, 2)  # the scales libjpeg decodes in the DCT domain
Channels = Literal["RGB", "BGR"]


@dataclass(frozen=True)
class ImageHeader:
    """What the header says, before any pixel is decoded. Width and height are as displayed
    (EXIF orientation applied) where the orientation is in the header."""

    format: str  # "JPEG", "PNG", "WEBP" or "BMP"; "PIXELS" for a payload already decoded
    width: int
    height: int
    orientation: int  # EXIF orientation tag, 1 = as stored
    mode: str  # Pillow's mode: "RGB", "L", "CMYK", "P", ...

    @property
    def pixels(self) -> int:
        return self.width * self.height

    @property
    def decoded_bytes(self) -> int:
        """What a full decode to three 8-bit channels allocates."""
        return 3 * self.pixels


class OpenedImage:
    """An image whose header has passed every check; `decode` turns it into pixels (or, for a
    payload already decoded, hands its pixels over)."""

    def __init__(self, body: bytes, image: Image.Image | None, header: ImageHeader,
                 pixels: np.ndarray | None = None) -> None:
        self._body = body
        self._image = image
        self._pixels = pixels
        self.header = header

    def decode(self, *, reduce: int = 1, channels: Channels = "RGB", fit: tuple[int, int] | None = None) -> np.ndarray:
        """HWC uint8 pixels, C-contiguous, EXIF orientation applied. `reduce` (1, 2, 4 or 8) asks a
        JPEG decoder for that scale from the DCT (sides rounded up); other formats ignore it, so
        callers read the size from the array. `fit` (short side, long side), instead of `reduce`,
        asks for the fastest decode that keeps a JPEG at least that size: the largest reduction
        `reduction_for` allows and libjpeg-turbo's fast inverse DCT and chroma upsampling (a level
        or two per pixel; its other scales, in eighths, decode slower than full size here). Raises
        InputError for corrupt or truncated data."""
        if reduce not in (1, *_REDUCTIONS):
            raise ValueError(f"reduce must be 1, 2, 4 or 8, got {reduce}")
        if fit is not None and reduce != 1:
            raise ValueError("decode takes reduce or fit, not both")
        if self._pixels is not None:  # decoded already: the same pixels, in the order asked for
            return np.ascontiguousarray(self._pixels[:, :, ::-1] if channels == "BGR" else self._pixels)
        assert self._image is not None
        plain_jpeg = self.header.format == "JPEG" and self.header.mode in ("RGB", "L")
        decoder = _simplejpeg()
        if fit is not None:
            reduce = reduction_for(self.header, *fit)
        if decoder is not None and plain_jpeg:
            return self._decode_turbo(decoder, reduce, channels, fast=fit is not None)
        cv2 = _cv2()
        if cv2 is not None and plain_jpeg:
            return self._decode_opencv(cv2, reduce, channels)
        pixels = self._decode_pillow()
        if channels == "BGR":
            pixels = np.ascontiguousarray(pixels[:, :, ::-1])
        return pixels

    def _decode_turbo(self, decoder: ModuleType, reduce: int, channels: Channels, fast: bool) -> np.ndarray:
        """libjpeg-turbo through simplejpeg: without `fast`, the same pixels as OpenCV's decoder in
        less than half the time here, straight into the channel order asked for."""
        assert self._image is not None
        stored = self._image.size  # (width, height) before orientation
        expected = (-(-stored[1] // reduce), -(-stored[0] // reduce), 3)
        try:
            pixels = decoder.decode_jpeg(self._body, colorspace=channels, min_height=expected[0],
                                         min_width=expected[1], min_factor=reduce, strict=True,
                                         fastdct=fast, fastupsample=fast)
        except ValueError as exc:
            raise InputError(f"corrupt or truncated image data: {str(exc).strip()[:200]}") from None
        if pixels.shape != expected:
            raise InputError("corrupt or truncated image data: the JPEG data could not be decoded")
        return _orient_array(pixels, self.header.orientation)

    def _decode_opencv(self, cv2: ModuleType, reduce: int, channels: Channels) -> np.ndarray:
        flags = {1: cv2.IMREAD_COLOR, 2: cv2.IMREAD_REDUCED_COLOR_2, 4: cv2.IMREAD_REDUCED_COLOR_4,
                 8: cv2.IMREAD_REDUCED_COLOR_8}[reduce] | cv2.IMREAD_IGNORE_ORIENTATION
        try:
            pixels = cv2.imdecode(np.frombuffer(self._body, np.uint8), flags)
        except cv2.error as exc:
            raise InputError(f"corrupt or truncated image data: {str(exc).strip()[:200]}") from None
        assert self._image is not None
        stored = self._image.size  # (width, height) before orientation
        expected = (-(-stored[1] // reduce), -(-stored[0] // reduce), 3)
        if pixels is None or pixels.shape != expected:
            raise InputError("corrupt or truncated image data: the JPEG data could not be decoded")
        pixels = _orient_array(pixels, self.header.orientation)
        if channels == "RGB":
            cv2.cvtColor(pixels, cv2.COLOR_BGR2RGB, dst=pixels)
        return np.asarray(pixels)

    def _decode_pillow(self) -> np.ndarray:
        image = self._image
        assert image is not None
        try:
            image.load()
            image = ImageOps.exif_transpose(image)
        except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:  # defensive: Pillow's own check
            raise PayloadTooLarge(f"image too large: {exc}") from None
        except _DECODE_ERRORS as exc:
            raise InputError(f"corrupt or truncated image data: {exc}") from None
        return _to_rgb_array(image)


def open_image(
    payload: Payload, *, max_pixels: int = DEFAULT_MAX_PIXELS, max_aspect_ratio: float = DEFAULT_MAX_ASPECT_RATIO
) -> OpenedImage:
    """Sniff the format and read only the header; refuse, before any decode, what is not accepted
    (415), empty or unreadable (400), over `max_pixels` (413) or more elongated than
    `max_aspect_ratio` (400). A payload with `pixels` is checked against the same limits."""
    if payload.pixels is not None:
        return _opened_pixels(payload, max_pixels, max_aspect_ratio)
    _check_media_type(payload.media_type)
    if not payload.body:
        raise InputError("empty image: the request body has no bytes")
    image, fmt = _open_header(payload.body, max_pixels)
    header = _header(image, fmt)
    _check_aspect_ratio(header, max_aspect_ratio)
    return OpenedImage(payload.body, image, header)


def decode_image(
    payload: Payload, *, max_pixels: int = DEFAULT_MAX_PIXELS, max_aspect_ratio: float = DEFAULT_MAX_ASPECT_RATIO
) -> np.ndarray:
    """Decode one payload to an RGB uint8 array of shape (height, width, 3), EXIF orientation applied.

    Raises InputError (empty, corrupt, truncated, too elongated), PayloadTooLarge (over
    `max_pixels`, checked from the header before decoding) or UnsupportedMediaType (declared type
    or real format not accepted).
    """
    return open_image(payload, max_pixels=max_pixels, max_aspect_ratio=max_aspect_ratio).decode()


def _opened_pixels(payload: Payload, max_pixels: int, max_aspect_ratio: float) -> OpenedImage:
    """A payload decoded already: its array checked for shape and against the limits."""
    pixels = payload.pixels
    if not (isinstance(pixels, np.ndarray) and pixels.dtype == np.uint8 and pixels.ndim == 3 and pixels.shape[2] == 3):
        got = f"{pixels.dtype} {pixels.shape}" if isinstance(pixels, np.ndarray) else type(pixels).__name__
        raise InputError(f"decoded pixels must be a uint8 (height, width, 3) RGB array, got {got}")
    height, width = pixels.shape[:2]
    if not (height and width):
        raise InputError(f"the decoded image is empty ({width}x{height})")
    limit, whose = _pixel_limit(max_pixels)
    if width * height > limit:
        raise PayloadTooLarge(f"image is {width}x{height} = {width * height} pixels; the limit is {limit} pixels{whose}")
    header = ImageHeader("PIXELS", width, height, 1, "RGB")
    _check_aspect_ratio(header, max_aspect_ratio)
    return OpenedImage(payload.body, None, header, pixels)


def reduction_for(header: ImageHeader, short_side: int, long_side: int) -> int:
    """The largest DCT reduction (1, 2, 4 or 8) that keeps a JPEG at least `short_side` x
    `long_side` (its short and long sides), so that a resize to that size still only shrinks."""
    if header.format != "JPEG":
        return 1
    short, long = sorted((header.width, header.height))
    for factor in _REDUCTIONS:
        if short // factor >= short_side and long // factor >= long_side:
            return factor
    return 1


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


def _open_header(body: bytes, max_pixels: int) -> tuple[Image.Image, str]:
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
    return image, fmt


def _header(image: Image.Image, fmt: str) -> ImageHeader:
    """The header's facts; the orientation only where the header holds it (JPEG's APP1 always does)."""
    try:
        orientation = int(image.getexif().get(_EXIF_ORIENTATION, 1)) if fmt == "JPEG" else 1
    except _DECODE_ERRORS:
        orientation = 1  # unreadable EXIF: shown as stored, as Pillow's exif_transpose would
    if orientation not in range(1, 9):
        orientation = 1
    width, height = image.size
    if orientation >= 5:  # 5 to 8 turn the image a quarter
        width, height = height, width
    return ImageHeader(fmt, width, height, orientation, image.mode)


def _check_aspect_ratio(header: ImageHeader, limit: float) -> None:
    short, long = sorted((header.width, header.height))
    if long > limit * short:
        raise InputError(
            f"image is {header.width}x{header.height}, an aspect ratio of {long / short:.4g}:1; "
            f"the limit is {limit:g}:1"
        )


def _accepts(fmt: str, prefix: bytes) -> bool:
    """Whether the format's magic-byte check passes; a str answer (Pillow's "almost") is a no."""
    accept = Image.OPEN[fmt][1]
    try:
        return accept is not None and accept(prefix) is True
    except Exception:  # noqa: BLE001  # some checks unpack fixed-size fields and fail on a short prefix
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
        except Exception:  # noqa: BLE001, S112  # not that format after all: try the next
            continue
        return fmt
    return None


@cache
def _cv2() -> ModuleType | None:
    """OpenCV, when installed (the bundled vision plugins depend on it); imported on first use,
    single-threaded: decoding runs one image per thread of the CPU pool, which is the parallelism."""
    try:
        import cv2
    except ImportError:
        return None
    cv2.setNumThreads(1)
    return cv2


@cache
def _simplejpeg() -> ModuleType | None:
    """simplejpeg (libjpeg-turbo), when installed: the fastest exact JPEG decoder here."""
    try:
        import simplejpeg
    except ImportError:
        return None
    module: ModuleType = simplejpeg
    return module


def _orient_array(pixels: np.ndarray, orientation: int) -> np.ndarray:
    """Apply an EXIF orientation as Pillow's exif_transpose does, in numpy (C-contiguous out)."""
    moves = {2: lambda p: p[:, ::-1], 3: lambda p: p[::-1, ::-1], 4: lambda p: p[::-1],
             5: lambda p: p.transpose(1, 0, 2), 6: lambda p: np.rot90(p, -1), 7: lambda p: p[::-1, ::-1].transpose(1, 0, 2),
             8: lambda p: np.rot90(p, 1)}
    move = moves.get(orientation)
    return pixels if move is None else np.ascontiguousarray(move(pixels))


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
