"""The limit: the workload's plugin called directly in a tight batched loop, in its own process.

Three figures, printed as one JSON document:
  - `with_decode_rps`: items per second for batches of `max_batch`, each input decoded from its
    bytes (preprocess), run (predict_batch) and formatted (postprocess);
  - `without_decode_rps`: the same with inputs preprocessed once, outside the loop;
  - `single_ms`: p50 and p90 of one input, end to end, batch of 1 (the "direct call" latency).

    python -m benchmarks.direct --workload resnet18 --seconds 6 --store model_store
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.workloads import WORKLOADS, Workload, build_plugin
from router.sdk.plugin import ModelPlugin, Payload

__all__ = ["measure"]


def _batched(plugin: ModelPlugin[Any], payload: Payload, n: int, seconds: float, decode: bool) -> float:
    """Items per second over `seconds` of back-to-back batches of `n`."""
    ready = [plugin.preprocess(payload) for _ in range(n)]
    done, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        items = [plugin.preprocess(payload) for _ in range(n)] if decode else ready
        outputs = plugin.predict_batch(items)
        for output, item in zip(outputs, items, strict=True):
            plugin.postprocess(output, item)
        done += n
    return done / (time.perf_counter() - start)


def _single(plugin: ModelPlugin[Any], payload: Payload, seconds: float) -> list[float]:
    latencies: list[float] = []
    stop = time.perf_counter() + seconds
    while time.perf_counter() < stop:
        start = time.perf_counter()
        item = plugin.preprocess(payload)
        plugin.postprocess(plugin.predict_batch([item])[0], item)
        latencies.append(time.perf_counter() - start)
    return sorted(latencies)


def measure(workload: Workload, store: Path, seconds: float, device: str = "cpu") -> dict[str, Any]:
    plugin = build_plugin(workload, store, device)
    payload = Payload(workload.request_body(), workload.content_type)
    _batched(plugin, payload, workload.max_batch, min(1.0, seconds / 4), decode=True)  # warm-up
    with_decode = _batched(plugin, payload, workload.max_batch, seconds, decode=True)
    without_decode = _batched(plugin, payload, workload.max_batch, seconds, decode=False)
    single = _single(plugin, payload, min(seconds, 2.0))

    def pick(q: float) -> float:
        return round(single[min(len(single) - 1, int(q * len(single)))] * 1000, 3)

    return {"workload": workload.name, "batch": workload.max_batch, "with_decode_rps": round(with_decode, 2),
            "without_decode_rps": round(without_decode, 2), "single_ms": {"p50": pick(0.5), "p90": pick(0.9)}}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", choices=sorted(WORKLOADS), required=True)
    parser.add_argument("--seconds", type=float, default=6.0)
    parser.add_argument("--store", type=Path, default=Path("model_store"))
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    json.dump(measure(WORKLOADS[args.workload], args.store.resolve(), args.seconds, args.device), sys.stdout)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
