"""The plugin contract: what a model family implements to be served.

A plugin class is registered under a name through the entry-point group `model_router.plugins`.
The router creates one plugin object per model instance, so an object serves one model on one
device and may keep state (the loaded network) on itself.

Required: `load`, `preprocess`, `predict_batch`, `memory_estimate`.
Optional hooks with defaults: `postprocess`, `describe_input`, `example_payload`, `warmup`, `unload`,
`agreement` (how far two answers agree, for comparing versions), and for a host split into
processes (`workers: N`), `front_state` and `adopt_front_state`.
Optional class attribute: `answers`, what `postprocess` answers, which pipelines' transforms check.

Where each hook runs. With one process, all of them run in it. With `workers: N` the host has N
front processes and one engine process: `load`, `predict_batch`, `memory_estimate`, `warmup` and
`unload` run in the engine, on the instance's thread, beside the loaded model; `preprocess`,
`postprocess` and `describe_input` run in a front, on a plugin object that was only constructed
(`__init__` with the options and the context: nothing is loaded there). What a front's object has
is its options, its context, and whatever the engine's loaded object returned from `front_state()`
(class names, input size, stride...), handed to `adopt_front_state()` once after each load. A
plugin whose `preprocess` needs the loaded model (JPEG decode on the GPU) sets
`preprocess_needs_model = True`, and its hooks then run in the engine.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Generic, TypeVar

from pydantic import BaseModel, ConfigDict

from router.sdk.agreement import default_agreement

__all__ = [
    "DETECTIONS",
    "PIXELS_MEDIA_TYPE",
    "PLUGINS_GROUP",
    "MemoryEstimate",
    "ModelPlugin",
    "NoOptions",
    "Payload",
    "PluginContext",
]


#: The entry-point group model plugins are declared under.
PLUGINS_GROUP = "model_router.plugins"
#: The media type of a payload that carries decoded pixels (`Payload.pixels`) instead of bytes.
PIXELS_MEDIA_TYPE = "image/x-pixels"
#: `ModelPlugin.answers` of a detector: `{"detections": [{"box": [x1, y1, x2, y2], "score": s, ...}, ...]}`,
#: boxes in the input image's pixels. The built-in `crop` transform reads it.
DETECTIONS = "detections"


class NoOptions(BaseModel):
    """Options model for plugins that take none. Unknown keys are rejected."""

    model_config = ConfigDict(extra="forbid", frozen=True)


OptionsT = TypeVar("OptionsT", bound=BaseModel)


@dataclass(frozen=True)
class Payload:
    """One input as it arrived: raw bytes and their media type (`image/jpeg`, `application/json`, ...).

    Inside a pipeline an image comes already decoded, once, by the router: `pixels` holds it (an
    RGB, HWC, uint8 numpy array, possibly a view into a larger image: a crop), and `decode_image`
    and `open_image` hand it over as if they had decoded `body`, which is then the original file
    (the pipeline's first model) or empty (a crop, `PIXELS_MEDIA_TYPE`)."""

    body: bytes
    media_type: str
    filename: str | None = None
    pixels: Any = field(default=None, compare=False, repr=False)


@dataclass(frozen=True)
class MemoryEstimate:
    """Device memory a model needs: weights held while loaded, plus a per-batch cost of
    `fixed_bytes + n * per_item_bytes` while a batch of n runs."""

    weights_bytes: int
    per_item_bytes: int
    fixed_bytes: int = 0
    source: str = "estimate"  # "estimate", "declared" or "profiled"

    def batch_bytes(self, n: int) -> int:
        return self.fixed_bytes + n * self.per_item_bytes


@dataclass(frozen=True)
class PluginContext:
    """What the router tells a plugin about where it runs."""

    model_name: str
    store_dir: Path
    allow_absolute_paths: bool = False
    extra: dict[str, Any] = field(default_factory=dict)
    #: Every path resolved through this context, as given and as resolved (`model-router check`
    #: reports those that do not exist).
    resolved: list[tuple[str, Path]] = field(default_factory=list, compare=False, repr=False)

    def resolve_path(self, path: str | Path) -> Path:
        """Resolve a model file path against the model store, refusing paths that escape it."""
        candidate = Path(path)
        if candidate.is_absolute():
            if not self.allow_absolute_paths:
                raise ValueError(
                    f"absolute path {str(path)!r} is not allowed; use a path relative to the model "
                    f"store {str(self.store_dir)!r} or set allow_absolute_paths"
                )
            self.resolved.append((str(path), candidate))
            return candidate
        store = self.store_dir.resolve()
        resolved = (store / candidate).resolve()
        if resolved != store and store not in resolved.parents:
            raise ValueError(f"path {str(path)!r} resolves outside the model store {str(store)!r}")
        self.resolved.append((str(path), resolved))
        return resolved


class ModelPlugin(ABC, Generic[OptionsT]):
    """One model family. Subclass it, set `Options` to a pydantic model, implement the four
    abstract methods, and declare the class under the `model_router.plugins` entry point."""

    Options: ClassVar[type[BaseModel]] = NoOptions
    #: Media types `preprocess` understands; `image/*` style wildcards are allowed.
    accepts: ClassVar[tuple[str, ...]] = ("image/*",)
    #: What `postprocess` answers, for the transforms of pipelines that check it: `DETECTIONS`, a
    #: word of the plugin's own ("classes"), or None: not declared (checked on each answer instead).
    answers: ClassVar[str | None] = None
    #: Whether torch's CUDA allocator holds this plugin's memory, so warm-up can profile it with
    #: torch.cuda.max_memory_allocated. Plugins on other runtimes (onnxruntime, TensorRT) set False.
    torch_memory: ClassVar[bool] = True
    #: Whether `preprocess` (and so `postprocess`) needs the loaded model. With `workers: N` such a
    #: plugin's hooks run in the engine process, beside it, and fronts send it the raw body.
    preprocess_needs_model: ClassVar[bool] = False
    #: Whether `predict_batch` always runs on the instance's own thread. By default a batch on the
    #: CPU that costs the event loop about what handing it to the thread and back would runs on the
    #: loop (docs/plugins.md); set True for a `predict_batch` that reads thread-local state `load`
    #: set, or that may wait on I/O or a lock.
    predict_on_own_thread: ClassVar[bool] = False

    def __init__(self, options: OptionsT, context: PluginContext) -> None:
        self.options = options
        self.context = context

    @abstractmethod
    def load(self, device: str) -> None:
        """Load weights onto `device` (`cpu` or `cuda:N`). Runs once, off the event loop."""

    @abstractmethod
    def preprocess(self, payload: Payload) -> Any:
        """Turn one payload into a model-ready item, on the CPU. Raise `InputError` for bad input."""

    @abstractmethod
    def predict_batch(self, items: Sequence[Any]) -> Sequence[Any]:
        """Run one batch on the device; return exactly one output per item, in order."""

    @abstractmethod
    def memory_estimate(self) -> MemoryEstimate:
        """Device memory this model needs, after `load`. The router may refine it by profiling."""

    def postprocess(self, output: Any, item: Any) -> Any:
        """Turn one output into a JSON-serialisable answer, on the CPU. `item` is what
        `preprocess` returned for the same input."""
        return output

    def describe_input(self, payload: Payload, item: Any) -> dict[str, Any]:
        """A few facts about one input for the request's log line, e.g. the image size."""
        return {}

    def example_payload(self) -> Payload | None:
        """A valid input used for warm-up and memory profiling; None disables both."""
        return None

    def warmup(self, batch_size: int) -> None:
        """Run one batch of `batch_size` example inputs so lazy initialisation happens before ready."""
        payload = self.example_payload()
        if payload is None:
            return
        item = self.preprocess(payload)
        self.predict_batch([item] * batch_size)

    def unload(self) -> None:
        """Release the model's memory. Called on shutdown and, later, on eviction."""

    def front_state(self) -> Any:
        """After `load`, in the engine: what `preprocess` and `postprocess` need that only loading
        can tell (class names, input size, stride), as any picklable value. The front processes'
        objects receive it through `adopt_front_state`. The default, None, is for plugins whose
        hooks need nothing beyond their options."""
        return None

    def adopt_front_state(self, state: Any) -> None:
        """In a front process, on an object that was constructed but never loaded: take what the
        engine's loaded object returned from `front_state`, before any `preprocess`."""

    def agreement(self, answer: Any, other: Any) -> float | None:
        """How far two answers of this plugin to the same input agree: 1.0 the same, 0.0 nothing in
        common, None when they cannot be compared. Versions of a model are compared with it (a
        rollout's candidate against the stable version, a mirror against the version routed to).
        The default compares top-1 classes (`top_k`), boxes by F1 (`detections`) or equal JSON
        (`router.sdk.agreement`); a plugin whose answers need another measure overrides it."""
        return default_agreement(answer, other)
