"""The yolo plugin against direct ultralytics calls, batching invariance, options and failure modes."""

from __future__ import annotations

import io
import json
import pickle
import subprocess
import sys
from collections.abc import Sequence
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

import cv2
import numpy as np
import pytest
import torch
from model_router_yolo import YoloOptions, YoloPlugin
from PIL import Image
from pydantic import ValidationError

from router.errors import InputError, UnsupportedMediaType
from router.sdk.plugin import Payload, PluginContext
from router.serving.registry import PluginRegistry

IMGSZ = 320  # small for speed; the comparison is the same at any size
CONF = 0.1  # the untrained demo model finds 0 to ~1200 boxes per test photo at this threshold
IOU = 0.7
MAX_DET = 3000  # above the 2100 anchors at imgsz 320: no truncation, so every box is compared
BOX_TOLERANCE_PX = 1.0
SCORE_TOLERANCE = 1e-4


def make_plugin(store: Path, **options: Any) -> YoloPlugin:
    return YoloPlugin(YoloOptions(**{"model": "yolov8n.pt", **options}), PluginContext("detector", store))


@pytest.fixture(scope="module")
def plugin(demo_store: Path) -> YoloPlugin:
    loaded = make_plugin(demo_store, imgsz=IMGSZ, conf=CONF, iou=IOU, max_det=MAX_DET)
    loaded.load("cpu")
    return loaded


@pytest.fixture(scope="module")
def reference(demo_store: Path) -> Any:
    from ultralytics import YOLO

    return YOLO(str(demo_store / "yolov8n.pt"))


def run(plugin: YoloPlugin, payloads: Sequence[Payload]) -> list[dict[str, Any]]:
    """preprocess -> one predict_batch -> postprocess, as the router does."""
    items = [plugin.preprocess(p) for p in payloads]
    outputs = plugin.predict_batch(items)
    assert len(outputs) == len(items)
    return [plugin.postprocess(output, item) for output, item in zip(outputs, items, strict=True)]


def direct(reference: Any, payload: Payload, **overrides: Any) -> list[dict[str, Any]]:
    """ultralytics' own predict on the same image, decoded independently with OpenCV (BGR, as it expects).

    rect=False: ultralytics' default for one image is a minimal-rectangle letterbox; the plugin
    letterboxes every image to the full square so that mixed sizes stack into one batch.
    """
    bgr = cv2.imdecode(np.frombuffer(payload.body, np.uint8), cv2.IMREAD_COLOR)
    args = {"imgsz": IMGSZ, "conf": CONF, "iou": IOU, "max_det": MAX_DET, "rect": False, "verbose": False, **overrides}
    (result,) = reference.predict(bgr, **args)
    boxes = result.boxes
    return [
        {"box": box, "score": score, "class_id": int(cls), "label": result.names[int(cls)]}
        for box, score, cls in zip(boxes.xyxy.tolist(), boxes.conf.tolist(), boxes.cls.tolist(), strict=True)
    ]


def assert_same_detections(got: list[dict[str, Any]], expected: list[dict[str, Any]], *, conf: float = CONF) -> None:
    """Every detection pairs up: same class and label, box within 1 px, score within 1e-4. Only a box
    whose score is within that tolerance of `conf` may be on one side alone (float noise decides)."""
    boxes = np.array([d["box"] for d in got], dtype=np.float64).reshape(-1, 4)
    scores = np.array([d["score"] for d in got], dtype=np.float64)
    classes = np.array([d["class_id"] for d in got], dtype=np.int64)
    labels = [d["label"] for d in got]
    free = np.ones(len(got), dtype=bool)
    for want in expected:
        fits = (
            free
            & (classes == want["class_id"])
            & (np.abs(scores - want["score"]) <= SCORE_TOLERANCE)
            & (np.abs(boxes - np.array(want["box"])).max(axis=1, initial=0.0) <= BOX_TOLERANCE_PX)
        )
        candidates = np.flatnonzero(fits)
        if candidates.size:
            free[candidates[0]] = False
            assert labels[candidates[0]] == want["label"]
        else:
            assert abs(want["score"] - conf) <= SCORE_TOLERANCE, f"missing {want}"
    for index in np.flatnonzero(free):
        assert abs(scores[index] - conf) <= SCORE_TOLERANCE, f"unexpected {got[index]}"


@pytest.mark.parametrize("batch_size", [1, 3, 8])
def test_batched_results_match_direct_ultralytics(
    plugin: YoloPlugin, reference: Any, payloads: list[Payload], batch_size: int
) -> None:
    batch = payloads[:batch_size]
    answers = run(plugin, batch)
    total = 0
    for payload, answer in zip(batch, answers, strict=True):
        expected = direct(reference, payload)
        assert len(expected) < MAX_DET
        assert_same_detections(answer["detections"], expected)
        height, width = cv2.imdecode(np.frombuffer(payload.body, np.uint8), cv2.IMREAD_COLOR).shape[:2]
        assert answer["image"] == {"width": width, "height": height}
        for detection in answer["detections"]:  # boxes are in the original image's pixels
            x1, y1, x2, y2 = detection["box"]
            assert 0 <= x1 <= x2 <= width and 0 <= y1 <= y2 <= height
        total += len(expected)
    assert len(answers[0]["detections"]) > 0 and total > 0, "the comparison needs detections to compare"


def test_batching_never_changes_an_answer(plugin: YoloPlugin, payloads: list[Payload]) -> None:
    together = run(plugin, payloads)
    assert len(payloads) == 8
    for payload, in_batch in zip(payloads, together, strict=True):
        (alone,) = run(plugin, [payload])
        assert in_batch["image"] == alone["image"]
        assert_same_detections(in_batch["detections"], alone["detections"])


@pytest.mark.parametrize("options", [
    {"classes": [0, 47, 79]},
    {"max_det": 5},
    {"conf": 0.2, "iou": 0.3},
])
def test_filtering_options_match_direct_ultralytics(
    demo_store: Path, reference: Any, payloads: list[Payload], options: dict[str, Any]
) -> None:
    variant = make_plugin(demo_store, imgsz=IMGSZ, **{"conf": CONF, "iou": IOU, "max_det": MAX_DET, **options})
    variant.load("cpu")
    for payload, answer in zip(payloads[:3], run(variant, payloads[:3]), strict=True):
        expected = direct(reference, payload, **options)
        assert_same_detections(answer["detections"], expected, conf=options.get("conf", CONF))
        if "classes" in options:
            assert {d["class_id"] for d in answer["detections"]} <= set(options["classes"])
        if "max_det" in options:
            assert len(answer["detections"]) <= options["max_det"]


def test_answers_are_json_with_labels_from_the_checkpoint(plugin: YoloPlugin, payloads: list[Payload]) -> None:
    (answer,) = run(plugin, payloads[:1])
    decoded = json.loads(json.dumps(answer))
    assert decoded == answer and decoded["detections"]
    first = decoded["detections"][0]
    assert set(first) == {"box", "score", "class_id", "label"} and len(first["box"]) == 4
    assert plugin.names[0] == "person" and first["label"] == plugin.names[first["class_id"]]


def test_custom_labels_replace_the_checkpoint_names(demo_store: Path, payloads: list[Payload]) -> None:
    labels = [f"thing-{i}" for i in range(80)]
    custom = make_plugin(demo_store, imgsz=IMGSZ, conf=CONF, labels=labels)
    custom.load("cpu")
    (answer,) = run(custom, payloads[:1])
    assert all(d["label"] == f"thing-{d['class_id']}" for d in answer["detections"])


def test_exif_orientation_reaches_the_answer(plugin: YoloPlugin, make_payload: Any) -> None:
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 degrees clockwise to display
    buffer = io.BytesIO()
    Image.open(io.BytesIO(make_payload(300, 200).body)).save(buffer, "JPEG", exif=exif)
    (answer,) = run(plugin, [Payload(buffer.getvalue(), "image/jpeg")])
    assert answer["image"] == {"width": 200, "height": 300}


def test_bad_images_raise_router_errors(plugin: YoloPlugin) -> None:
    with pytest.raises(InputError, match="empty image"):
        plugin.preprocess(Payload(b"", "image/jpeg"))
    with pytest.raises(UnsupportedMediaType):
        plugin.preprocess(Payload(b"GIF89a....", "image/gif"))


def test_unidentifiable_upload_never_triggers_ultralytics_auto_install(
    plugin: YoloPlugin, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Importing ultralytics wraps PIL.Image.open so that an unidentifiable file pip-installs pi-heif;
    uploads are decoded without going through that wrapper."""

    def no_subprocess(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError(f"a subprocess was started: {args!r}")

    monkeypatch.setattr(subprocess, "Popen", no_subprocess)
    with pytest.raises(InputError, match="corrupt or truncated image data"):
        plugin.preprocess(Payload(b"definitely not an image", "application/octet-stream"))


def test_example_payload_and_warmup(plugin: YoloPlugin) -> None:
    payload = plugin.example_payload()
    assert payload.media_type == "image/jpeg"
    plugin.warmup(2)


def test_memory_estimate_counts_weights_and_scales_with_imgsz(demo_store: Path, plugin: YoloPlugin) -> None:
    estimate = plugin.memory_estimate()
    network = plugin._loaded().model
    expected = sum(t.numel() * t.element_size() for t in [*network.parameters(), *network.buffers()])
    assert estimate.weights_bytes == expected > 5_000_000  # yolov8n: ~3.2 M fp32 parameters, fused
    assert estimate.per_item_bytes > 3 * IMGSZ * IMGSZ * 5
    bigger = make_plugin(demo_store, imgsz=2 * IMGSZ)
    bigger.load("cpu")
    ratio = bigger.memory_estimate().per_item_bytes / estimate.per_item_bytes
    assert 3.5 < ratio < 4.5  # activations grow with the pixel count


def test_architecture_yaml_builds_offline_and_deterministically(demo_store: Path, payloads: list[Payload]) -> None:
    answers = []
    for _ in range(2):
        built = make_plugin(demo_store, model="yolov8n.yaml", imgsz=IMGSZ, conf=0.0, max_det=10)
        built.load("cpu")
        answers.append(run(built, payloads[:1]))
    assert answers[0] == answers[1]


def test_demo_checkpoint_is_a_real_ultralytics_checkpoint(demo_store: Path, reference: Any) -> None:
    from ultralytics.nn.tasks import torch_safe_load

    assert reference.task == "detect" and reference.names[0] == "person" and len(reference.names) == 80
    checkpoint, _ = torch_safe_load(demo_store / "yolov8n.pt", safe_only=True)  # loads with weights_only=True
    assert isinstance(checkpoint["model"], torch.nn.Module)


def test_registered_under_the_yolo_entry_point() -> None:
    (point,) = [p for p in entry_points(group="model_router.plugins") if p.name == "yolo"]
    assert point.load() is YoloPlugin
    assert PluginRegistry.from_entry_points().get("yolo").cls is YoloPlugin


# --- options and load-time validation ------------------------------------------------------------


@pytest.mark.parametrize("options, message", [
    ({"model": "yolov8n.onnx"}, "model must be a .pt checkpoint or a .yaml architecture, got 'yolov8n.onnx'"),
    ({"model": "yolov8n.pt", "imgsz": 330}, "imgsz must be a positive multiple of 32, got 330; try 320"),
    ({"model": "yolov8n.pt", "conf": 1.5}, "less than or equal to 1"),
    ({"model": "yolov8n.pt", "classes": [-1]}, "classes must be a non-empty list of class ids >= 0"),
    ({"model": "yolov8n.pt", "nms": True}, "Extra inputs are not permitted"),
    ({}, "model\n  Field required"),
])
def test_bad_options_are_rejected_with_a_clear_message(options: dict[str, Any], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        YoloOptions(**options)


def test_defaults() -> None:
    options = YoloOptions(model="yolov8n.pt")
    assert (options.imgsz, options.conf, options.iou, options.max_det) == (640, 0.25, 0.7, 300)
    assert (options.classes, options.half, options.labels) == (None, False, None)


@pytest.mark.parametrize("path, message", [
    ("../outside.pt", "resolves outside the model store"),
    ("/etc/yolov8n.pt", "absolute path '/etc/yolov8n.pt' is not allowed"),
])
def test_paths_outside_the_store_are_refused_at_construction(demo_store: Path, path: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make_plugin(demo_store, model=path)


def test_missing_checkpoint_fails_to_load_without_any_download(tmp_path: Path) -> None:
    # yolov8n.pt is also the name of an official asset ultralytics would fetch if asked.
    missing = make_plugin(tmp_path, model="yolov8n.pt")
    with pytest.raises(FileNotFoundError, match=r"'yolov8n\.pt' not found in the model store .*init-demo"):
        missing.load("cpu")


def test_half_on_cpu_is_refused_with_the_reason(demo_store: Path) -> None:
    with pytest.raises(ValueError, match="half: true needs a CUDA device, got 'cpu'"):
        make_plugin(demo_store, half=True).load("cpu")


@pytest.mark.parametrize("options, message", [
    ({"labels": ["a", "b"]}, "labels has 2 names but the model has 80 classes"),
    ({"classes": [80]}, r"classes \[80\] has ids beyond the model's 80 classes"),
])
def test_options_that_contradict_the_checkpoint_fail_at_load(
    demo_store: Path, options: dict[str, Any], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        make_plugin(demo_store, **options).load("cpu")


@pytest.mark.gpu
def test_half_on_cuda_agrees_with_fp32(demo_store: Path, payloads: list[Payload]) -> None:
    full = make_plugin(demo_store, imgsz=IMGSZ, conf=CONF)
    full.load("cuda:0")
    half = make_plugin(demo_store, imgsz=IMGSZ, conf=CONF, half=True)
    half.load("cuda:0")
    for a, b in zip(run(full, payloads), run(half, payloads), strict=True):
        assert a["image"] == b["image"]
        strong = [d for d in a["detections"] if d["score"] > CONF + 0.05]
        for want in strong:
            assert any(
                d["class_id"] == want["class_id"] and abs(d["score"] - want["score"]) < 0.02 for d in b["detections"]
            )


@pytest.mark.parametrize(("height", "width"), [(480, 640), (1080, 810), (37, 3000), (320, 320), (5, 7)])
def test_scale_boxes_gives_ultralytics_bits_without_torch(height: int, width: int) -> None:
    """The front's numpy `scale_boxes` is ultralytics' torch one, float32 for float32, clipping included."""
    from model_router_yolo.processing import scale_boxes
    from ultralytics.utils.ops import scale_boxes as reference

    rng = np.random.default_rng(height * width)
    boxes = rng.uniform(-40, IMGSZ + 40, size=(500, 4)).astype(np.float32)
    want = reference((IMGSZ, IMGSZ), torch.from_numpy(boxes.copy()), (height, width)).numpy()
    got = scale_boxes((IMGSZ, IMGSZ), boxes.copy(), (height, width))
    assert got.dtype == np.float32 and np.array_equal(got, want)
    assert want.min() == 0 and (want[:, [0, 2]].max(), want[:, [1, 3]].max()) == (width, height)  # clipping ran


def test_front_hooks_run_without_torch(demo_store: Path, plugin: YoloPlugin, payloads: list[Payload]) -> None:
    """What a split host's front runs (build, adopt the front state, preprocess, postprocess) imports
    neither torch nor ultralytics, and answers what the loaded plugin answers."""
    item = plugin.preprocess(payloads[0])
    output = plugin.predict_batch([item])[0]
    script = (
        "import pickle, sys\n"
        "from pathlib import Path\n"
        "from model_router_yolo import YoloOptions, YoloPlugin\n"
        "from router.sdk.plugin import PluginContext\n"
        "state, payload, output = pickle.loads(sys.stdin.buffer.read())\n"
        f"front = YoloPlugin(YoloOptions(model='yolov8n.pt', imgsz={IMGSZ}), PluginContext('detector', Path(sys.argv[1])))\n"
        "front.adopt_front_state(state)\n"
        "item = front.preprocess(payload)\n"
        "answer = front.postprocess(output, item)\n"
        "heavy = sorted(m for m in ('torch', 'torchvision', 'ultralytics') if m in sys.modules)\n"
        "sys.stdout.buffer.write(pickle.dumps((heavy, item.pixels, answer)))\n"
    )
    done = subprocess.run([sys.executable, "-c", script, str(demo_store)], capture_output=True, check=False, timeout=120,
                          input=pickle.dumps((plugin.front_state(), payloads[0], output)))
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    heavy, pixels, answer = pickle.loads(done.stdout)
    assert heavy == []
    assert np.array_equal(pixels, item.pixels) and answer == plugin.postprocess(output, item)
