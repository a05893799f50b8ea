"""Preprocessing cost per image on one thread: the old host pipeline against the plugins' own.

"before" is a reference copy of the pipeline the plugins had before issue 12 (Pillow decode and
RGB conversion, then torchvision's resize and crop for ResNet, ultralytics' LetterBox and a CHW
copy for YOLO); "after" is the plugins' processing as served (`decode: exact`, and `fast`).
The variants run interleaved, in a shuffled order each round, so that other load on the machine
(and the cache one variant leaves to the next) hits them alike; each figure is the median over
the rounds.

    python -m benchmarks.preprocess [--rounds 40]
"""

from __future__ import annotations

import argparse
import io
import json
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from PIL import Image, ImageOps

from benchmarks.workloads import ultralytics_asset
from router.sdk.plugin import Payload

__all__ = ["images", "measure"]


def images() -> dict[str, Payload]:
    """bus.jpg (810x1080), zidane.jpg (1280x720), and a 4032x3024 JPEG made from zidane.jpg."""
    import cv2

    found = {name: Payload(Path(ultralytics_asset(name)).read_bytes(), "image/jpeg") for name in ("bus.jpg", "zidane.jpg")}
    bgr = cv2.imdecode(np.frombuffer(found["zidane.jpg"].body, np.uint8), cv2.IMREAD_COLOR)
    large = cv2.resize(bgr, (4032, 3024), interpolation=cv2.INTER_CUBIC)
    found["zidane-4032x3024.jpg"] = Payload(cv2.imencode(".jpg", large, [cv2.IMWRITE_JPEG_QUALITY, 90])[1].tobytes(),
                                            "image/jpeg")
    return found


def _pillow_rgb(payload: Payload) -> np.ndarray:
    image = ImageOps.exif_transpose(Image.open(io.BytesIO(payload.body)))
    return np.asarray(image.convert("RGB"), dtype=np.uint8).copy()


def old_resnet(payload: Payload) -> torch.Tensor:
    """The ResNet preprocessing before issue 12: Pillow, then torchvision on the full-size tensor."""
    from torchvision.transforms import InterpolationMode
    from torchvision.transforms import functional as TF

    image = torch.from_numpy(_pillow_rgb(payload)).permute(2, 0, 1)
    image = TF.resize(image, [256], interpolation=InterpolationMode.BILINEAR, antialias=True)
    image = TF.convert_image_dtype(TF.center_crop(image, [224]), torch.float)
    mean, std = torch.tensor((0.485, 0.456, 0.406)).view(3, 1, 1), torch.tensor((0.229, 0.224, 0.225)).view(3, 1, 1)
    return (image - mean) / std


def old_yolo(letterbox: Any) -> Callable[[Payload], torch.Tensor]:
    """The YOLO preprocessing before issue 12: Pillow, ultralytics' LetterBox, a CHW copy."""

    def run(payload: Payload) -> torch.Tensor:
        boxed = letterbox(image=_pillow_rgb(payload))
        return torch.from_numpy(boxed.transpose(2, 0, 1).copy())

    return run


def variants() -> dict[str, dict[str, Callable[[Payload], Any]]]:
    from model_router_resnet.processing import ClassifyProcessing
    from model_router_yolo.processing import DetectSettings, YoloProcessing
    from ultralytics.data.augment import LetterBox

    def yolo(mode: Literal["exact", "fast"]) -> Callable[[Payload], Any]:
        return YoloProcessing(640, 32, [str(i) for i in range(80)], DetectSettings(), decode_mode=mode).preprocess

    return {
        "resnet": {"before": old_resnet, "exact": ClassifyProcessing().preprocess,
                   "fast": ClassifyProcessing(decode_mode="fast").preprocess},
        "yolo": {"before": old_yolo(LetterBox((640, 640), auto=False, stride=32)), "exact": yolo("exact"),
                 "fast": yolo("fast")},
    }


def measure(rounds: int) -> dict[str, Any]:
    """Median milliseconds per image for each plugin, image and variant, on one thread."""
    import cv2

    torch.set_num_threads(1)
    cv2.setNumThreads(1)
    payloads, results, shuffle = images(), {}, random.Random(0)
    plan = variants()
    # Warm every variant on every image before timing any: once a process has freed a large buffer,
    # glibc serves buffers of that size from its heap instead of fresh mmap pages (as in a server,
    # whose batches free megabytes all the time). Timed before that, Pillow's copies pay page faults
    # (bus.jpg: 10-11 ms instead of 4-5), so which variant ran first would decide the figures.
    for runs in plan.values():
        for payload in payloads.values():
            for run in runs.values():
                run(payload)
    for plugin, runs in plan.items():
        for name, payload in payloads.items():
            times: dict[str, list[float]] = {variant: [] for variant in runs}
            for _ in range(rounds if "4032" not in name else max(3, rounds // 8)):
                order = list(runs.items())
                shuffle.shuffle(order)
                for variant, run in order:
                    started = time.perf_counter()
                    run(payload)
                    times[variant].append((time.perf_counter() - started) * 1000)
            medians = {variant: round(statistics.median(ms), 2) for variant, ms in times.items()}
            speedups = {f"speedup_{v}": round(medians["before"] / medians[v], 2) for v in runs if v != "before"}
            results[f"{plugin} {name}"] = {"ms": medians, **speedups}
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=40)
    args = parser.parse_args()
    json.dump(measure(args.rounds), sys.stdout, indent=1)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
