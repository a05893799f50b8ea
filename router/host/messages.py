"""The messages between a front process and the engine process: frozen msgspec structs, tagged,
encoded as MessagePack, framed with a 4-byte length. Arrays never travel in them; a `Packed`
value names its arrays' places in a shared-memory arena (`router.host.packing`). The values both
sides read, a request's `Terms` and the `BatchFacts` of the batch it rode, are the request path's
own (`router.serving.rules`, `router.scheduling.queue`), declared once, beside the code that makes them.

See docs/architecture-processes.md for when each is sent.
"""

from __future__ import annotations

import struct
from typing import Any

import msgspec

from router.errors import RouterError, error_named
from router.scheduling.queue import BatchFacts
from router.serving.rules import Terms
from router.serving.traffic import Observation
from router.serving.verbs import AdminVerb

__all__ = [
    "Call",
    "CallReply",
    "Cancel",
    "EngineMessage",
    "Failure",
    "Frames",
    "FrontMessage",
    "Hello",
    "Lags",
    "ModelEntry",
    "Models",
    "Observed",
    "Packed",
    "PayloadRef",
    "Release",
    "Reply",
    "Snapshot",
    "Submit",
    "Welcome",
    "encode_frame",
]

HEADER = struct.Struct("<I")
#: A frame longer than this is a protocol error (a front's Submit is a few hundred bytes; a
#: Snapshot of many models some kilobytes; a PUT section at most 1 MB).
MAX_FRAME = 64 * 1024 * 1024


class _Message(msgspec.Struct, frozen=True, array_like=True, tag=True, gc=False):
    """Base of every message: tagged by class name."""


class Packed(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """A Python value: its pickle (protocol 5) with its large buffers out of band, and where in
    the sender's arena each of those buffers is: (offset, length), in order."""

    skeleton: bytes
    regions: tuple[tuple[int, int], ...] = ()


class PayloadRef(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """A raw request body for hooks that run in the engine: its bytes as a one-array `Packed`."""

    media_type: str
    filename: str | None
    body: Packed
    pixels: Packed | None = None  # a pipeline's decoded image (`Payload.pixels`), through the arena too


class Failure(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """A RouterError as data: its class name, words, headers and retry hint."""

    kind: str
    detail: str
    headers: dict[str, str] = {}
    retry_after_s: float | None = None

    @classmethod
    def of(cls, error: RouterError) -> Failure:
        return cls(type(error).__name__, error.detail, dict(error.headers), error.retry_after_s)

    def error(self) -> RouterError:
        return error_named(self.kind, self.detail, headers=self.headers, retry_after_s=self.retry_after_s)


class ModelEntry(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """One model as a front needs it: to build its plugin object, find its board slot, and run its hooks."""

    name: str
    slot: int
    plugin: str
    options: bytes  # the options as JSON
    generation: int
    store_dir: str
    allow_absolute_paths: bool
    hooks_in_engine: bool  # preprocess_needs_model: the front sends the raw body
    queue_timeout_ms: int  # the deadline of a request that asks for none
    execution_timeout_ms: int  # how long a running batch may take
    queue_capacity: int  # how many items its queue holds
    priority_levels: int
    accepts: tuple[str, ...]  # the media types its plugin accepts
    front_state: bytes | None = None  # pickled front_state() after load; None before the first load


# -- front -> engine --------------------------------------------------------------------------------


class Hello(_Message):
    front: int
    pid: int
    arena_bytes: int


class Submit(_Message):
    id: int
    terms: Terms
    request_id: str
    generation: int
    input_bytes: int
    item: Packed | None = None
    payload: PayloadRef | None = None
    trace: bytes | None = None  # the sampled request's span (`SpanRef.to_bytes`), which its batch span links to


class Cancel(_Message):
    id: int
    expired: bool  # the deadline passed (else: the client went away)


class Release(_Message):
    """Regions (offsets) of the front's answer arena it has finished with."""

    offsets: tuple[int, ...]


class Lags(_Message):
    """Per model: (answers, seconds summed) from batch end to answer, since the last Lags."""

    models: dict[str, tuple[int, float]]


class Observed(_Message):
    """What a front saw of routed names' versions since the last Observed, for their rollouts."""

    observations: tuple[Observation, ...]


class Call(_Message):
    """An admin verb for the engine's runtime, its arguments in it (`router.serving.verbs`); one `CallReply` answers it."""

    id: int
    verb: AdminVerb


# -- engine -> front --------------------------------------------------------------------------------


class Welcome(_Message):
    engine_pid: int
    epoch: int
    board_bytes: int
    arena_bytes: int


class Models(_Message):
    """The fleet as a front needs it, whole: a front swaps its copy for this one, unless it
    already holds a later generation of the fleet (`FleetState.generation`)."""

    models: tuple[ModelEntry, ...]
    pipelines: bytes = b""  # the pipelines served (msgpack, `router.serving.verbs.pipeline_wire` each)
    routes: bytes = b""  # the routed names' routes (msgpack of `VersionRoute`s)
    generation: int = 0  # the fleet's generation this describes


class Reply(_Message):
    """The one answer to a Submit."""

    id: int
    output: Packed | None = None  # for the front's postprocess
    answer: bytes | None = None  # hooks in the engine: the final answer (msgpack) ...
    input_info: bytes | None = None  # ... and describe_input's facts (msgpack)
    failure: Failure | None = None
    facts: BatchFacts | None = None


class Snapshot(_Message):
    ready: bool
    draining: bool
    models: bytes  # msgpack of the ModelInfo list
    devices: bytes  # msgpack of the DeviceInfo list
    rollouts: bytes = b""  # msgpack of {name: its rollout, as `Runtime.rollout` describes it}


class CallReply(_Message):
    id: int
    result: bytes = b""  # msgpack
    failure: Failure | None = None


FrontMessage = Hello | Submit | Cancel | Release | Lags | Observed | Call
EngineMessage = Welcome | Models | Reply | Snapshot | CallReply

_ENCODER = msgspec.msgpack.Encoder()


def encode_frame(message: msgspec.Struct, out: bytearray) -> None:
    """Append `message` to `out` as one frame."""
    start = len(out)
    out += b"\0\0\0\0"
    _ENCODER.encode_into(message, out, len(out))
    HEADER.pack_into(out, start, len(out) - start - 4)


class Frames:
    """Splits a byte stream into decoded messages of one union type."""

    def __init__(self, kind: type) -> None:
        self._decoder = msgspec.msgpack.Decoder(kind)
        self._buffer = bytearray()

    def feed(self, data: bytes | bytearray | memoryview) -> list[Any]:
        """The messages of every frame that `data` completes; the rest waits for the next feed.
        ValueError for a frame over MAX_FRAME, msgspec.DecodeError for one that does not decode."""
        buffer = self._buffer
        buffer += data
        messages = []
        position, end = 0, len(buffer)
        with memoryview(buffer) as view:
            while end - position >= 4:
                (length,) = HEADER.unpack_from(view, position)
                if length > MAX_FRAME:
                    raise ValueError(f"a frame of {length} bytes is over the limit of {MAX_FRAME}")
                if end - position - 4 < length:
                    break
                messages.append(self._decoder.decode(view[position + 4:position + 4 + length]))
                position += 4 + length
        del buffer[:position]
        return messages
