"""The client chain: detect-classify done by a client without pipelines, in N+1 HTTP requests.

    python -m benchmarks.pipeline_chain --url http://127.0.0.1:8000 --photo bus.jpg --photo zidane.jpg \\
        --crop '{"max_items": 4}' --concurrency 16 --duration 20

Per image: POST it to /models/yolov8n/predict; then, in the client, decode it, cut the crops the
router's crop step would cut (the same options, through the same `plan_crops`), encode each as a
JPEG (quality 95) and POST them all at once to /models/resnet18/predict. An image's latency runs
from its first request to its last answer. Closed loop; prints the load generator's summary, one
"request" per image. Its own process, so the client's decoding and encoding cost what they cost.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path
from urllib.parse import urlsplit

import numpy as np
import simplejpeg

from benchmarks.loadgen import Pool, Result, Target, exchange, summarise
from router.sdk.crop import CropOptions, plan_crops

__all__ = ["main"]

DETECT = "/models/yolov8n/predict"
CLASSIFY = "/models/resnet18/predict"


def cut_and_encode(photo: bytes, detections: list[dict[str, object]], options: CropOptions) -> list[bytes]:
    """What the client must do between the two models: decode, crop, encode again."""
    pixels = simplejpeg.decode_jpeg(photo, colorspace="RGB")
    height, width = pixels.shape[:2]
    plan = plan_crops(width, height, detections, options)
    return [simplejpeg.encode_jpeg(np.ascontiguousarray(pixels[top:bottom, left:right]), quality=95, colorspace="RGB")
            for _, (left, top, right, bottom) in plan.kept]


async def one_image(pool: Pool, photo: bytes, options: CropOptions, timeout_s: float) -> Result:
    start = time.perf_counter()
    try:
        status, _, body = await exchange(pool, Target(DETECT, "image/jpeg", photo), {}, timeout_s)
        if status != 200:
            return Result("chain", status, time.perf_counter() - start, False)
        crops = await asyncio.to_thread(cut_and_encode, photo, json.loads(body)["result"]["detections"], options)
        answers = await asyncio.gather(*(exchange(pool, Target(CLASSIFY, "image/jpeg", crop), {}, timeout_s)
                                         for crop in crops))
        status = next((s for s, _, _ in answers if s != 200), 200)
        return Result("chain", status, time.perf_counter() - start, False)
    except (TimeoutError, ConnectionError, asyncio.IncompleteReadError, OSError) as exc:
        return Result("chain", 0, time.perf_counter() - start, False, type(exc).__name__)


async def run(args: argparse.Namespace) -> dict[str, object]:
    url = urlsplit(args.url)
    pool = Pool(url.hostname or "127.0.0.1", url.port or 80)
    photos = [Path(p).read_bytes() for p in args.photo]
    options = CropOptions(**json.loads(args.crop))
    stop = time.perf_counter() + args.duration
    results: list[Result] = []

    async def worker(index: int) -> None:
        turn = index
        while time.perf_counter() < stop:
            results.append(await one_image(pool, photos[turn % len(photos)], options, args.timeout))
            turn += 1

    started = time.perf_counter()
    await asyncio.gather(*(worker(i) for i in range(args.concurrency)))
    elapsed = max(args.duration, time.perf_counter() - started)
    return {"mode": "closed", "concurrency": args.concurrency, "duration_s": args.duration,
            "connections_opened": pool.opened, **summarise(results, elapsed)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", required=True)
    parser.add_argument("--photo", action="append", required=True)
    parser.add_argument("--crop", default="{}", help="the crop step's options, JSON")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--duration", type=float, default=20.0)
    parser.add_argument("--timeout", type=float, default=120.0)
    args = parser.parse_args(argv)
    json.dump(asyncio.run(run(args)), sys.stdout)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
