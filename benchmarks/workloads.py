"""The three benchmark workloads, and the one place every contender gets its model from.

Each workload names a router plugin and its options. The router serves it through a fleet file;
the peers (the single-queue server, LitServe) and the direct loop build the *same* plugin object
with `build_plugin`, so every contender runs identical preprocessing, model and postprocessing.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from router.sdk.plugin import ModelPlugin, PluginContext
from router.serving.registry import PluginRegistry

__all__ = ["ALL_WORKLOADS", "HOST_WORKLOADS", "REPO", "WORKLOADS", "Workload", "build_plugin", "server_arguments",
           "ultralytics_asset"]

REPO = Path(__file__).resolve().parents[1]
TOY_INPUT = json.dumps({"x": [0.1 * i for i in range(16)]}).encode()


@dataclass(frozen=True)
class Workload:
    """One model, its batching and its request body, shared by every contender."""

    name: str
    plugin: str
    options: dict[str, Any]
    max_batch: int
    max_delay_ms: float
    content_type: str
    body_file: str | None = None  # relative to the repo, or absolute; else `body`
    body: bytes = b""
    queue_size: int = 128
    timeout_ms: int = 10_000  # as the single-queue server's submit timeout; open-loop runs ask for 1 s per request
    extra: dict[str, Any] = field(default_factory=dict)

    def request_body(self) -> bytes:
        return (REPO / self.body_file).read_bytes() if self.body_file else self.body

    def fleet_yaml(self, store: Path) -> str:
        """A one-model router fleet for this workload."""
        options = json.dumps(self.options)
        return (
            f"model_store: {store}\n"
            "models:\n"
            f"  {self.name}:\n"
            f"    plugin: {self.plugin}\n"
            "    device: cpu\n"
            f"    options: {options}\n"
            f"    queue: {{max_size: {self.queue_size}, timeout_ms: {self.timeout_ms}}}\n"
            f"    batch: {{max_size: {self.max_batch}, max_delay_ms: {self.max_delay_ms}}}\n"
        )


def ultralytics_asset(name: str) -> str:
    """A real photo shipped in ultralytics' package assets (`bus.jpg` 810x1080, `zidane.jpg` 1280x720),
    found without importing ultralytics."""
    spec = importlib.util.find_spec("ultralytics")
    if spec is None or spec.origin is None:
        raise RuntimeError("ultralytics is not installed: the photo workloads use its assets")
    return str(Path(spec.origin).parent / "assets" / name)


WORKLOADS: dict[str, Workload] = {
    # The default fleet's ResNet settings: batches of up to 8, 5 ms from the first arrival.
    "resnet18": Workload("resnet18", "resnet", {"arch": "resnet18", "weights": "resnet18.pt", "top_k": 5},
                         max_batch=8, max_delay_ms=5, content_type="image/jpeg", body_file="examples/street.jpg"),
    # The same model on a real photo (bus.jpg, 810x1080 JPEG): the host pipeline decodes a large image.
    "photo": Workload("photo", "resnet", {"arch": "resnet18", "weights": "resnet18.pt", "top_k": 5},
                      max_batch=8, max_delay_ms=5, content_type="image/jpeg", body_file=ultralytics_asset("bus.jpg")),
    # A simulated accelerator: a batch of n costs 20 + 0.5 n ms of wall time with the GIL released.
    "accelerator": Workload("accelerator", "scripted", {"fixed_ms": 20, "per_item_ms": 0.5},
                            max_batch=32, max_delay_ms=5, content_type="application/json",
                            body=b'{"id": "bench"}', queue_size=256, extra={"fixed_ms": 20.0, "per_item_ms": 0.5}),
    # A 16->32->4 MLP: the router's own overhead. No batching delay, so nothing but overhead is added.
    "tiny": Workload("tiny", "toy", {}, max_batch=8, max_delay_ms=0, content_type="application/json", body=TOY_INPUT),
}


#: The split host's workloads (benchmarks/split_host.py): what a fast GPU asks of the host side.
HOST_WORKLOADS: dict[str, Workload] = {
    # A fast accelerator: a batch of n costs 2 + 0.05 n ms with the GIL released, in batches of 64
    # (a full batch: 5.2 ms for 64 answers, 12,300 answers a second from one instance).
    "fast": Workload("fast", "scripted", {"fixed_ms": 2, "per_item_ms": 0.05}, max_batch=64, max_delay_ms=2,
                     content_type="application/json", body=b'{"id": "bench"}', queue_size=2048,
                     extra={"fixed_ms": 2.0, "per_item_ms": 0.05}),
    # No model at all (the scripted plugin with no delay): the host side's own work per request.
    "noop": Workload("noop", "scripted", {}, max_batch=8, max_delay_ms=0, content_type="application/json",
                     body=b'{"id": "bench"}', queue_size=1024),
}
ALL_WORKLOADS: dict[str, Workload] = {**WORKLOADS, **HOST_WORKLOADS}


def build_plugin(workload: Workload, store: Path, device: str = "cpu") -> ModelPlugin[Any]:
    """The workload's plugin object, loaded on `device`, exactly as the router would build it."""
    info = PluginRegistry.from_entry_points(only=[workload.plugin]).get(workload.plugin)
    plugin = info.cls(info.cls.Options(**workload.options), PluginContext(workload.name, store))
    plugin.load(device)
    return plugin


def server_arguments(description: str | None, parser: argparse.ArgumentParser | None = None,
                     ) -> tuple[Workload, int, Path, argparse.Namespace]:
    """The command line every contender server takes: --workload, --port, --store (and what
    `parser` adds)."""
    parser = parser or argparse.ArgumentParser(description=description,
                                               formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", choices=sorted(ALL_WORKLOADS), required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--store", type=Path, default=Path("model_store"))
    args = parser.parse_args()
    return ALL_WORKLOADS[args.workload], args.port, args.store.resolve(), args
