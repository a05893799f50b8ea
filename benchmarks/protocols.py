"""tritonclient over gRPC against tritonclient over HTTP, on one router, one model and the same inputs.

    python -m benchmarks.protocols [--seconds 8] [--store model_store] [--scratch DIR]

Two models: ResNet18 (the demo weights, batches of up to 8), whose CPU inference dwarfs any transport,
and the example plugin mean-colour (decode and sample the image: the protocol's own cost shows).
ultralytics' bus.jpg (810x1080), closed loop at concurrency 4 (threads, one client each, in a
process of their own), for `seconds / 2` each after a warm-up, in three forms: the JPEG bytes
(BYTES [1]); its decoded pixels inline (UINT8 [1, 1080, 810, 3], 2.6 MB a request); and the same
pixels through system shared memory (each client writes its frame into its own region before every
request, as a camera process would, and sends the region's name). Each form over gRPC and over
HTTP, one after the other on the same server, twice (the order of the protocols swapped the second
time). Prints JSON: requests/s, p50/p90/p99 of the answered requests, statuses, and the gRPC / HTTP
ratios of throughput and p99 (medians of the rounds' side-by-side pairs).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np
from tritonclient.utils import InferenceServerException

from benchmarks.systems import free_port, serve_router
from benchmarks.workloads import REPO, ultralytics_asset

__all__ = ["main"]

CONCURRENCY = 4
ROUNDS = 2
FORMS = ("jpeg", "pixels", "pixels_shm")
PROTOCOLS = ("grpc", "http")
MODELS = ("resnet18", "mean-colour")
FLEET = """
model_store: {store}
models:
  resnet18:
    plugin: resnet
    options: {{arch: resnet18, weights: resnet18.pt, top_k: 5}}
    queue: {{max_size: 64, timeout_ms: 10000}}
    batch: {{max_size: 8, max_delay_ms: 5}}
  mean-colour:
    plugin: mean-colour
    queue: {{max_size: 64, timeout_ms: 10000}}
    batch: {{max_size: 8, max_delay_ms: 2}}
"""


def _pixels() -> np.ndarray[Any, Any]:
    from router.sdk.images import decode_image
    from router.sdk.plugin import Payload

    return decode_image(Payload(Path(ultralytics_asset("bus.jpg")).read_bytes(), "image/jpeg"))[None]


class Driver:
    """One client thread's requests in one form: an inline tensor, or a region it rewrites each time."""

    def __init__(self, model: str, protocol: str, form: str, address: str, jpeg: bytes,
                 pixels: np.ndarray[Any, Any]) -> None:
        import tritonclient.grpc as grpcclient
        import tritonclient.http as httpclient
        import tritonclient.utils.shared_memory as shm

        self.model, self.shm, self.pixels = model, shm, pixels
        module: Any = grpcclient if protocol == "grpc" else httpclient
        self.client = module.InferenceServerClient(address)
        self.region: Any = None
        if form == "jpeg":
            self.tensor = module.InferInput("IMAGE", [1], "BYTES")
            self.tensor.set_data_from_numpy(np.array([jpeg], dtype=np.object_))
            return
        self.tensor = module.InferInput("IMAGE", list(pixels.shape), "UINT8")
        if form == "pixels":
            self.tensor.set_data_from_numpy(pixels)
            return
        name, key = f"bench-{uuid.uuid4().hex[:8]}", f"/model-router-bench-{uuid.uuid4().hex}"
        self.region = shm.create_shared_memory_region(name, key, pixels.nbytes)
        self.client.register_system_shared_memory(name, key, pixels.nbytes)
        self.tensor.set_shared_memory(name, pixels.nbytes)

    def request(self) -> None:
        if self.region is not None:
            self.shm.set_shared_memory_region(self.region, [self.pixels])
        self.client.infer(self.model, [self.tensor])

    def close(self) -> None:
        if self.region is not None:
            self.client.unregister_system_shared_memory()
            self.shm.destroy_shared_memory_region(self.region)


def drive(model: str, protocol: str, form: str, address: str, seconds: float, warm_s: float) -> dict[str, Any]:
    """Closed loop from CONCURRENCY threads: requests/s and latency percentiles after a warm-up."""
    jpeg, pixels = Path(ultralytics_asset("bus.jpg")).read_bytes(), _pixels()
    started = time.monotonic() + 1.0  # time for every thread to make its client
    measure_from, stop_at = started + warm_s, started + warm_s + seconds
    latencies: list[float] = []
    statuses: dict[str, int] = {}
    lock = threading.Lock()

    def loop() -> None:
        driver = Driver(model, protocol, form, address, jpeg, pixels)  # in its thread: tritonclient.http's gevent needs it
        try:
            _requests(driver)
        finally:
            driver.close()

    def _requests(driver: Driver) -> None:
        while (now := time.monotonic()) < stop_at:
            try:
                driver.request()
                status = "ok"
            except Exception as exc:  # noqa: BLE001  # a refusal counts, by its status; the loop goes on
                status = str(exc.status()) if isinstance(exc, InferenceServerException) else type(exc).__name__
            if now >= measure_from:
                with lock:
                    statuses[status] = statuses.get(status, 0) + 1
                    if status == "ok":
                        latencies.append((time.monotonic() - now) * 1000)

    threads = [threading.Thread(target=loop) for _ in range(CONCURRENCY)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return {"model": model, "protocol": protocol, "form": form, "concurrency": CONCURRENCY, "requests": sum(statuses.values()),
            "throughput_rps": round(len(latencies) / seconds, 1), "goodput_rps": round(len(latencies) / seconds, 1),
            "statuses": statuses, "ok_ms": _percentiles(latencies)}


def _percentiles(values: list[float]) -> dict[str, float | None]:
    if len(values) < 2:
        return {"p50": None, "p90": None, "p99": None}
    cuts = statistics.quantiles(values, n=100, method="inclusive")
    return {"p50": round(cuts[49], 1), "p90": round(cuts[89], 1), "p99": round(cuts[98], 1)}


def run(store: Path, scratch: Path, seconds: float, rounds: int = ROUNDS) -> dict[str, Any]:
    """Every model and form over both protocols, `rounds` times, the protocols' order swapped each round
    (the machine's other work drifts): the ratios are medians of each round's side-by-side pair."""
    grpc_port = free_port()
    runs: dict[str, Any] = {}
    with serve_router(FLEET.format(store=store), scratch, env_extra={"MODEL_ROUTER_GRPC_PORT": str(grpc_port)}) as server:
        addresses = {"grpc": f"127.0.0.1:{grpc_port}", "http": server.url.removeprefix("http://")}
        for round_ in range(rounds):
            for model in MODELS:
                for form in FORMS:
                    for protocol in PROTOCOLS if round_ % 2 == 0 else PROTOCOLS[::-1]:
                        runs[f"{model}:{protocol}/{form}#{round_}"] = _driver(model, protocol, form, addresses[protocol],
                                                                              seconds / 2)
    ratios = {f"{model}:{form}": {
        "throughput_grpc_over_http": _median_ratio(runs, f"{model}:", form, "throughput_rps", rounds),
        "p99_grpc_over_http": _median_ratio(runs, f"{model}:", form, "p99", rounds),
    } for model in MODELS for form in FORMS}
    return {"models": list(MODELS), "input": "bus.jpg 810x1080", "concurrency": CONCURRENCY, "seconds": seconds / 2,
            "rounds": rounds, "runs": runs, "ratios": ratios}


def _driver(model: str, protocol: str, form: str, address: str, seconds: float) -> dict[str, Any]:
    command = [sys.executable, "-m", "benchmarks.protocols", "--drive", protocol, "--model", model, "--form", form,
               "--address", address, "--seconds", str(seconds)]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=seconds * 4 + 120, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"driver {model} {protocol}/{form} failed: {done.stderr[-2000:]}")
    result: dict[str, Any] = json.loads(done.stdout)
    print(f"[protocols] {model} {protocol}/{form}: {result['throughput_rps']} rps, p99 {result['ok_ms']['p99']} ms, "
          f"{result['statuses']}", file=sys.stderr, flush=True)
    return result


def _median_ratio(runs: dict[str, Any], model: str, form: str, figure: str, rounds: int) -> float | None:
    def value(run: dict[str, Any]) -> float | None:
        return run["ok_ms"][figure] if figure == "p99" else run[figure]

    ratios = [_ratio(value(runs[f"{model}grpc/{form}#{r}"]), value(runs[f"{model}http/{form}#{r}"])) for r in range(rounds)]
    known = [r for r in ratios if r is not None]
    return round(statistics.median(known), 3) if known else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a is not None and b else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--store", type=Path, default=REPO / "model_store")
    parser.add_argument("--scratch", type=Path, default=REPO / "benchmarks" / "results" / "scratch")
    parser.add_argument("--drive", choices=PROTOCOLS, help="(internal) run one driver and print its JSON")
    parser.add_argument("--form", choices=FORMS)
    parser.add_argument("--model", choices=MODELS)
    parser.add_argument("--address")
    args = parser.parse_args(argv)
    if args.drive:
        print(json.dumps(drive(args.model, args.drive, args.form, args.address, args.seconds,
                               warm_s=min(2.0, args.seconds / 4))))
        return 0
    args.scratch.mkdir(parents=True, exist_ok=True)
    print(json.dumps(run(args.store.resolve(), args.scratch, args.seconds)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
