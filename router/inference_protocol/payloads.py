"""From V2 tensors to the payloads a model takes, and its answers back to output elements: one
mapping for every protocol, so HTTP and gRPC give a model the same bytes and a client the same answer.

Every model is described by its media types (`ModelPlugin.accepts`), so any plugin is served:

- image models take `IMAGE`: encoded images as `BYTES` `[N]`, or decoded pixels as `UINT8`
  `[N, H, W, 3]` (each item is re-encoded losslessly as an uncompressed BMP);
- JSON models take `JSON` (`BYTES` `[N]`, one JSON document per item), or any named tensors,
  which become one JSON object per item: `{"x": [...]}` from an input `x` of shape `[N, ...]`;
- other models take `INPUT` (`BYTES` `[N]`), passed through as bytes.

Every model answers `OUTPUT` (`BYTES` `[N]`): each item's native JSON answer as a string.
"""

from __future__ import annotations

import enum
import io
from collections.abc import Sequence
from dataclasses import dataclass
from fnmatch import fnmatch
from typing import Any, Final

import msgspec
import numpy as np
from PIL import Image

from router.errors import InputError, PayloadTooLarge, brief, clip
from router.inference_protocol.request import InferRequest, RequestedOutput
from router.inference_protocol.tensors import Tensor
from router.sdk.images import DEFAULT_MAX_PIXELS
from router.sdk.plugin import Payload

__all__ = ["OUTPUT_NAME", "InputKind", "Signature", "answer_elements", "select_outputs", "signature", "to_payloads"]

OUTPUT_NAME: Final = "OUTPUT"
_JSON: Final = msgspec.json.Encoder()  # what the HTTP framework encodes answers with too: the same bytes


class InputKind(enum.Enum):
    IMAGE = "IMAGE"
    JSON = "JSON"
    RAW = "INPUT"


@dataclass(frozen=True)
class Signature:
    """How a model's inputs and outputs look over V2, derived from the media types its plugin accepts."""

    kind: InputKind
    media_type: str  # what each item's Payload declares

    @property
    def input_name(self) -> str:
        return self.kind.value

    def metadata(self) -> dict[str, list[dict[str, Any]]]:
        """`inputs` and `outputs` of the model metadata; -1 marks the batch dimension."""
        return {
            "inputs": [{"name": self.input_name, "datatype": "BYTES", "shape": [-1]}],
            "outputs": [{"name": OUTPUT_NAME, "datatype": "BYTES", "shape": [-1]}],
        }


def signature(accepts: Sequence[str]) -> Signature:
    """The V2 signature of a plugin that accepts these media types (`image/*` wildcards allowed)."""
    if any(pattern.lower().startswith("image/") for pattern in accepts):
        return Signature(InputKind.IMAGE, "application/octet-stream")  # the image decoder sniffs the format
    if any(fnmatch("application/json", pattern.lower()) for pattern in accepts):
        return Signature(InputKind.JSON, "application/json")
    concrete = [a for a in accepts if "*" not in a]
    return Signature(InputKind.RAW, concrete[0] if concrete else "application/octet-stream")


def to_payloads(request: InferRequest, model: str, sig: Signature) -> list[Payload]:
    """One payload per item of the batch dimension, in order."""
    sizes = {t.shape[0] for t in request.inputs}
    if len(sizes) != 1:
        shapes = ", ".join(f"{clip(t.name, 40)} {list(t.shape)}" for t in request.inputs[:4])
        raise InputError(f"every input must have the same batch size (first dimension); got {shapes}")
    if sizes == {0}:
        raise InputError("the batch is empty: the inputs' first dimension is 0")
    if sig.kind is InputKind.JSON and not (len(request.inputs) == 1 and request.inputs[0].name == sig.input_name):
        return _json_objects(request.inputs, sig)
    tensor = _only_input(request.inputs, model, sig)
    if sig.kind is InputKind.IMAGE and tensor.datatype == "UINT8" and len(tensor.shape) == 4 and tensor.shape[3] == 3:
        height, width = tensor.shape[1:3]
        if height * width > DEFAULT_MAX_PIXELS:  # refused before any image is re-encoded
            raise PayloadTooLarge(f"input {brief(tensor.name, 64)}: images of {width}x{height} pixels are over the "
                                  f"limit of {DEFAULT_MAX_PIXELS} pixels")
        return [_bmp(pixels) for pixels in tensor.data]
    if tensor.datatype == "BYTES" and (len(tensor.shape) == 1 or tensor.shape[1:] == (1,)):
        return [Payload(bytes(element), sig.media_type) for element in tensor.data.reshape(-1)]
    forms = "BYTES [N] or UINT8 [N,H,W,3]" if sig.kind is InputKind.IMAGE else "BYTES [N]"
    raise InputError(
        f"input {brief(tensor.name, 64)} of model {model!r} must be {forms}, got {tensor.datatype} {list(tensor.shape)}"
    )


def _only_input(inputs: Sequence[Tensor], model: str, sig: Signature) -> Tensor:
    names = [t.name for t in inputs]
    if names != [sig.input_name]:
        raise InputError(f"model {model!r} takes one input named {sig.input_name!r}, got {brief(names)}")
    return inputs[0]


def _bmp(pixels: np.ndarray[Any, Any]) -> Payload:
    """Decoded RGB pixels as an uncompressed BMP: lossless, cheap, and read by every image plugin."""
    if not pixels.size:
        raise InputError(f"an image of shape {list(pixels.shape)} has no pixels")
    buffer = io.BytesIO()
    Image.fromarray(np.ascontiguousarray(pixels), "RGB").save(buffer, format="BMP")
    return Payload(buffer.getvalue(), "image/bmp")


def _json_objects(inputs: Sequence[Tensor], sig: Signature) -> list[Payload]:
    """Named tensors of a JSON model as one object per item: `{"x": row i of x, ...}`."""
    if any(t.name == sig.input_name for t in inputs):
        raise InputError(f"input {sig.input_name!r} holds whole JSON documents; send it alone, not with other inputs")
    columns = {t.name: _json_values(t) for t in inputs}
    count = inputs[0].shape[0]
    return [Payload(_JSON.encode({name: rows[i] for name, rows in columns.items()}), sig.media_type) for i in range(count)]


def _json_values(tensor: Tensor) -> list[Any]:
    if tensor.datatype != "BYTES":
        return list(tensor.data.tolist())
    try:
        text = np.array([b.decode("utf-8") for b in tensor.data.reshape(-1)], dtype=object)
    except UnicodeDecodeError as exc:
        raise InputError(f"input {brief(tensor.name, 64)}: BYTES elements must be UTF-8 text for this model: {exc}") from None
    return list(text.reshape(tensor.shape).tolist())


def select_outputs(request: InferRequest, sig: Signature) -> tuple[RequestedOutput, ...]:
    """The outputs to answer with: those asked for, else all of them in the request's default form."""
    available = [o["name"] for o in sig.metadata()["outputs"]]
    if request.outputs is None:
        return tuple(RequestedOutput(name, request.binary_output) for name in available)
    unknown = [o.name for o in request.outputs if o.name not in available]
    if unknown:
        raise InputError(f"unknown output {brief(unknown[0], 64)}; outputs: {', '.join(available)}")
    return request.outputs


def answer_elements(answers: Sequence[Any]) -> list[bytes]:
    """Each item's answer as its JSON text: the elements of the `OUTPUT` tensor."""
    return [_JSON.encode(answer) for answer in answers]
