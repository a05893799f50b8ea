"""LitServe as a contender: the workload's plugin behind a `LitAPI`, batching as the router's.

`max_batch_size` and `batch_timeout` equal the router's `batch.max_size` and `max_delay_ms`.
LitServe parses JSON bodies itself and takes binary uploads as multipart, so images arrive as
the form field `file` and JSON is handed to the plugin re-encoded (microseconds for these bodies).

    python -m benchmarks.litserve_app --workload tiny --port 8002 --store model_store [--api-servers N|auto]

`--api-servers` is LitServe's `num_api_servers`: 1 unless asked (the three original workloads);
`auto` is LitServe's own default and its documented recommendation (None: as many HTTP server
processes as inference workers, here one), N runs N of them (its docs: "2-8 depending on load").
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

# LitServe and its Lightning helpers must never reach the network from a benchmark.
os.environ.setdefault("LIGHTNING_TELEMETRY", "0")
os.environ.setdefault("LITSERVE_TELEMETRY", "0")
os.environ.setdefault("DO_NOT_TRACK", "1")

import litserve as ls

from benchmarks.workloads import Workload, build_plugin, server_arguments
from router.sdk.plugin import Payload

__all__ = ["PluginAPI"]


class PluginAPI(ls.LitAPI):
    """decode_request -> preprocess, predict -> predict_batch, encode_response -> postprocess."""

    def __init__(self, workload: Workload, store: Path) -> None:
        super().__init__(max_batch_size=workload.max_batch, batch_timeout=workload.max_delay_ms / 1000.0)
        self.workload = workload
        self.store = store

    def setup(self, device: str) -> None:
        self.plugin = build_plugin(self.workload, self.store)

    # No annotation on `request`: LitServe reads it to choose how the body is parsed.
    def decode_request(self, request):  # type: ignore[no-untyped-def]
        if "file" in request:  # multipart upload
            upload = request["file"]
            body = upload.file.read() if hasattr(upload, "file") else bytes(upload)
            return self.plugin.preprocess(Payload(body, self.workload.content_type))
        return self.plugin.preprocess(Payload(json.dumps(request).encode(), "application/json"))

    def batch(self, inputs: Sequence[Any]) -> list[Any]:
        return list(inputs)

    def predict(self, x: Sequence[Any]) -> list[Any]:
        return list(self.plugin.predict_batch(x))

    def unbatch(self, output: Sequence[Any]) -> list[Any]:
        return list(output)

    def encode_response(self, output: Any) -> dict[str, Any]:
        return {"result": self.plugin.postprocess(output, None)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--api-servers", default="1", help="LitServe's num_api_servers: a number, or auto (None)")
    workload, port, store, args = server_arguments(__doc__, parser)
    api = PluginAPI(workload, store)
    server = ls.LitServer(api, accelerator="cpu", workers_per_device=1, timeout=10)
    api_servers = None if args.api_servers == "auto" else int(args.api_servers)
    server.run(host="127.0.0.1", port=port, num_api_servers=api_servers, log_level="warning",
               generate_client_file=False)


if __name__ == "__main__":
    main()
