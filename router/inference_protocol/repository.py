"""What the V2 server, model and repository calls answer, from the serving core's snapshots: the
same values over HTTP (as JSON) and gRPC (as messages)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final

from router import __version__
from router.devices import device_index
from router.errors import ModelNotFound, brief
from router.inference_protocol.payloads import OUTPUT_NAME, signature
from router.serving.snapshots import ModelInfo

__all__ = [
    "EXTENSIONS",
    "MODEL_VERSION",
    "SERVER_NAME",
    "TRITON_STATES",
    "IndexEntry",
    "check_version",
    "index_entries",
    "model_config",
    "model_metadata",
    "model_statistics",
    "server_metadata",
]

SERVER_NAME: Final = "model-router"
MODEL_VERSION: Final = "1"
EXTENSIONS: Final = ("binary_tensor_data", "model_repository", "system_shared_memory", "statistics")
#: Triton's model states, from the router's.
TRITON_STATES: Final = {
    "ready": "READY", "degraded": "READY", "pending": "LOADING", "loading": "LOADING", "draining": "UNLOADING",
    "unloading": "UNLOADING", "unloaded": "UNAVAILABLE", "failed": "UNAVAILABLE",
}


def check_version(name: str, version: str | None) -> None:
    """Every model has the one version "1"; an empty or absent version means it."""
    if version and version != MODEL_VERSION:
        raise ModelNotFound(f"model {name!r} has no version {brief(version, 40)}; versions: {MODEL_VERSION}")


def server_metadata() -> dict[str, Any]:
    return {"name": SERVER_NAME, "version": __version__, "extensions": list(EXTENSIONS)}


def model_metadata(model: ModelInfo, *, pipeline: str | None = None, name: str | None = None,
                   versions: Sequence[str] = (MODEL_VERSION,)) -> dict[str, Any]:
    """A model's metadata; with `pipeline`, that pipeline's (it takes what its entry `model` takes),
    on the platform Triton gives its ensembles. `name` and `versions`: a model with versions, as
    its clients name it (`model` is the version the call named, or the stable one)."""
    platform = "ensemble" if pipeline is not None else f"model-router/{model.plugin['name']}"
    return {"name": pipeline or name or model.name, "versions": list(versions), "platform": platform,
            **signature(model.accepts).metadata()}


@dataclass(frozen=True)
class IndexEntry:
    name: str
    version: str
    state: str
    reason: str


def index_entries(models: list[ModelInfo], *, ready_only: bool,
                  pipelines: Sequence[tuple[str, bool, str | None]] = ()) -> list[IndexEntry]:
    """The repository index: every model (or the ready ones) with Triton's word for its state; then
    the `pipelines` (name, serving, error), which V2 clients see as models (Triton's ensembles)."""
    entries = [IndexEntry(m.name, MODEL_VERSION, TRITON_STATES[m.state], m.error or "") for m in models]
    entries += [IndexEntry(name, MODEL_VERSION, "READY" if serving else "UNAVAILABLE", error or "")
                for name, serving, error in pipelines]
    return [e for e in entries if e.state == "READY"] if ready_only else entries


def model_config(model: ModelInfo) -> dict[str, Any]:
    """The model's configuration in the fields of Triton's `ModelConfig` that mean something here:
    the plugin as backend, the batch size and delay, the priority levels, one instance group per device."""
    sig = signature(model.accepts)
    groups: dict[str, dict[str, Any]] = {}
    for device in model.devices:
        group = groups.setdefault(device, {"name": f"{model.name}_{device.replace(':', '_')}", "count": 0,
                                           "kind": "KIND_CPU" if device == "cpu" else "KIND_GPU"})
        group["count"] += 1
        index = device_index(device)
        if index is not None:
            group["gpus"] = [index]
    return {
        "name": model.name, "platform": f"model-router/{model.plugin['name']}", "backend": str(model.plugin["name"]),
        "max_batch_size": model.batch_max_size,
        "input": [{"name": sig.input_name, "data_type": "TYPE_STRING", "dims": [1]}],
        "output": [{"name": OUTPUT_NAME, "data_type": "TYPE_STRING", "dims": [1]}],
        "instance_group": list(groups.values()),
        "dynamic_batching": {"max_queue_delay_microseconds": int(model.batch_max_delay_ms * 1000),
                             "priority_levels": model.priority_levels},
    }


def model_statistics(model: ModelInfo) -> dict[str, Any]:
    """Triton's statistics of one model, with the figures we have: counts of items answered and
    failed, and of batches run. Durations and the last inference's time are not measured: 0."""
    succeeded = int(model.requests.get("ok", 0))
    failed = sum(int(count) for outcome, count in model.requests.items() if outcome != "ok")
    none = {"count": 0, "ns": 0}
    return {
        "name": model.name, "version": MODEL_VERSION, "last_inference": 0, "inference_count": succeeded,
        "execution_count": sum(i.batches for i in model.instances),
        "inference_stats": {"success": {"count": succeeded, "ns": 0}, "fail": {"count": failed, "ns": 0},
                            "queue": none, "compute_input": none, "compute_infer": none, "compute_output": none},
        "batch_stats": [],
    }
