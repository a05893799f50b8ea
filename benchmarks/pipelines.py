"""The `pipeline` workload: detect-classify on real photos at concurrency 16, three ways, one run.

    python -m benchmarks.pipelines [--seconds 30] [--store model_store] [--scratch DIR]

bus.jpg and zidane.jpg in turn, closed loop, 16 clients, on the default fleet's models (the demo
YOLOv8n, its crop step, the demo ResNet18; every time limit raised to 60 s: deadlines are not what
is measured here):

- `router`: POST /models/detect-classify/predict, one request per image;
- `client_chain`: the same router, chained by a client over HTTP (`benchmarks.pipeline_chain`:
  the detector, then a JPEG of each crop to the classifier: N+1 requests);
- `ray_serve`: Ray Serve 2.60 composition as its documentation advises, through its HTTP proxy:
  a detector deployment calling a classifier deployment through a handle, each with
  `@serve.batch` (the fleet's batch sizes and delays) and the same plugin code run in a thread;
  the image decoded once in the detector, each crop sent through the handle as a numpy array.
  Default replica resources (one CPU each, of the two Ray is given).

Prints one JSON document: each system's summary (`throughput_rps` is images per second, `ok_ms`
their latency), the classifier's mean batch under the router, and the router's ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Any

from benchmarks.cluster import loadgen
from benchmarks.systems import free_port, serve_router
from benchmarks.workloads import REPO, ultralytics_asset

__all__ = ["main"]

CONCURRENCY = 16
PIPELINE = "detect-classify"
WARM_S = 4.0


def fleet_text(store: Path) -> str:
    """config/fleet.yaml on this store, every time limit at 60 s."""
    text = (REPO / "config" / "fleet.yaml").read_text(encoding="utf-8").replace("model_store: ../model_store",
                                                                                   f"model_store: {store}")
    return re.sub(r"timeout_ms: \d+", "timeout_ms: 60000", text)


def crop_options(fleet: Path) -> dict[str, Any]:
    from router.config import load_fleet

    return dict(load_fleet(fleet).pipelines[PIPELINE].steps[1].options)


def classifier_batch(url: str) -> float | None:
    """The mean size of the batch each crop ran in, from the router's /metrics."""
    with urllib.request.urlopen(url + "/metrics", timeout=30) as reply:
        text = reply.read().decode()
    labels = f'{{pipeline="{PIPELINE}",step="2:resnet18"}}'
    values = {name: float(value) for name, _, value in (line.partition(labels) for line in text.splitlines())
              if name in ("model_router_pipeline_step_batch_size_sum", "model_router_pipeline_step_batch_size_count")}
    count = values.get("model_router_pipeline_step_batch_size_count")
    return round(values["model_router_pipeline_step_batch_size_sum"] / count, 3) if count else None


def chain(url: str, photos: list[str], crop: dict[str, Any], seconds: float) -> dict[str, Any]:
    command = [sys.executable, "-m", "benchmarks.pipeline_chain", "--url", url, *[f"--photo={p}" for p in photos],
               "--crop", json.dumps(crop), "--concurrency", str(CONCURRENCY), "--duration", str(seconds)]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=seconds + 300, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"client chain failed ({done.returncode}): {done.stderr[-2000:]}")
    report: dict[str, Any] = json.loads(done.stdout)
    return report


def router_runs(store: Path, scratch: Path, seconds: float, photos: list[str]) -> dict[str, Any]:
    """The router's pipeline, then the client chain against the same server."""
    text = fleet_text(store)
    crop = crop_options(_written(scratch / "pipeline-fleet.yaml", text))
    targets = [f"/models/{PIPELINE}/predict=image/jpeg:@{photo}" for photo in photos]
    with serve_router(text, scratch) as server:
        loadgen(server.url, targets, "--concurrency", str(CONCURRENCY), "--cycle", "--duration", str(WARM_S))
        router = loadgen(server.url, targets, "--concurrency", str(CONCURRENCY), "--cycle", "--duration", str(seconds))
        router["classifier_mean_batch"] = classifier_batch(server.url)
        chain(server.url, photos, crop, WARM_S)
        client_chain = chain(server.url, photos, crop, seconds)
    return {"router": router, "client_chain": client_chain}


def _written(path: Path, text: str) -> Path:
    path.write_text(text, encoding="utf-8")
    return path


def ray_app(fleet: Path) -> Any:
    """Ray Serve's model composition: a detector deployment calling a classifier through a handle."""
    from ray import serve
    from starlette.requests import Request
    from starlette.responses import JSONResponse

    from router.config import load_fleet

    config = load_fleet(fleet)
    det, cls = config.models["yolov8n"].batch, config.models["resnet18"].batch
    crop = crop_options(fleet)

    @serve.deployment(max_ongoing_requests=4 * CONCURRENCY)
    class Classifier:
        def __init__(self) -> None:
            self.plugin = fleet_plugin(fleet, "resnet18")

        @serve.batch(max_batch_size=cls.max_size, batch_wait_timeout_s=cls.max_delay_s)
        async def classify(self, crops: list[Any]) -> list[Any]:
            return await asyncio.to_thread(_run_batch, self.plugin, crops)

    @serve.deployment(max_ongoing_requests=4 * CONCURRENCY)
    class Detector:
        def __init__(self, classifier: Any) -> None:
            self.classifier = classifier
            self.plugin = fleet_plugin(fleet, "yolov8n")

        @serve.batch(max_batch_size=det.max_size, batch_wait_timeout_s=det.max_delay_s)
        async def detect(self, images: list[Any]) -> list[Any]:
            return await asyncio.to_thread(_run_batch, self.plugin, images)

        async def __call__(self, request: Request) -> Any:
            from router.sdk import Payload, decode_image
            from router.sdk.crop import CropOptions, plan_crops

            pixels = await asyncio.to_thread(decode_image, Payload(await request.body(), "image/jpeg"))
            answer = await self.detect(pixels)
            plan = plan_crops(pixels.shape[1], pixels.shape[0], answer["detections"], CropOptions(**crop))
            classes = await asyncio.gather(*(self.classifier.classify.remote(pixels[t:b, left:r])
                                             for _, (left, t, r, b) in plan.kept))
            detections = [{**answer["detections"][i], "resnet18": c} for (i, _), c in zip(plan.kept, classes, strict=True)]
            return JSONResponse({**answer, "detections": detections})

    return Detector.bind(Classifier.bind())


def fleet_plugin(fleet: Path, name: str) -> Any:
    """A model of the fleet file as its plugin object, loaded on the CPU, as the router builds it."""
    from router.sdk import PluginContext
    from router.serving.plan import load_plan

    plan = load_plan(fleet)
    model = plan.models[name]
    plugin = model.plugin.cls(model.options, PluginContext(name, plan.fleet.model_store))
    plugin.load("cpu")
    return plugin


def _run_batch(plugin: Any, images: list[Any]) -> list[Any]:
    """preprocess, predict_batch, postprocess: what the router's queue does around a batch."""
    from router.sdk import PIXELS_MEDIA_TYPE, Payload

    items = [plugin.preprocess(Payload(b"", PIXELS_MEDIA_TYPE, pixels=image)) for image in images]
    return [plugin.postprocess(output, item) for output, item in zip(plugin.predict_batch(items), items, strict=True)]


def ray_runs(store: Path, scratch: Path, seconds: float, photos: list[str]) -> dict[str, Any]:
    import ray
    from ray import serve

    fleet = _written(scratch / "pipeline-fleet.yaml", fleet_text(store))
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    url = f"http://127.0.0.1:{port}"
    targets = [f"/=image/jpeg:@{photo}" for photo in photos]
    try:
        serve.run(ray_app(fleet), name="pipeline", route_prefix="/")
        loadgen(url, targets, "--concurrency", str(CONCURRENCY), "--cycle", "--duration", str(WARM_S))
        return loadgen(url, targets, "--concurrency", str(CONCURRENCY), "--cycle", "--duration", str(seconds))
    finally:
        serve.shutdown()
        ray.shutdown()


def measure(store: Path, scratch: Path, seconds: float) -> dict[str, Any]:
    photos = [ultralytics_asset("bus.jpg"), ultralytics_asset("zidane.jpg")]
    out: dict[str, Any] = {"seconds": seconds, "concurrency": CONCURRENCY, "photos": ["bus.jpg", "zidane.jpg"],
                           **router_runs(store, scratch, seconds, photos),
                           "ray_serve": ray_runs(store, scratch, seconds, photos)}
    rps = {system: out[system]["throughput_rps"] for system in ("router", "client_chain", "ray_serve")}
    p99 = {system: out[system]["ok_ms"]["p99"] for system in rps}
    out["images_per_s"], out["p99_ms"] = rps, p99
    out["ratios"] = {f"router_over_{s}": round(rps["router"] / max(rps[s], 1e-9), 3) for s in ("client_chain", "ray_serve")}
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--store", type=Path, default=REPO / "model_store")
    parser.add_argument("--scratch", type=Path, default=REPO / "benchmarks" / "results" / "scratch")
    args = parser.parse_args(argv)
    args.scratch.mkdir(parents=True, exist_ok=True)
    json.dump(measure(args.store.resolve(), args.scratch, args.seconds), sys.stdout)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
