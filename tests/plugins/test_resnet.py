"""The resnet plugin against direct torchvision calls, batching invariance, options and failure modes."""

from __future__ import annotations

import json
from collections.abc import Sequence
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

import cv2
import numpy as np
import pytest
import torch
import torchvision
from model_router_resnet import ARCHS, ResNetOptions, ResNetPlugin
from pydantic import ValidationError

from router.errors import InputError
from router.sdk.plugin import Payload, PluginContext
from router.serving.registry import PluginRegistry

SCORE_TOLERANCE = 1e-4  # the router against itself (batching)
# Against torchvision's float reference: the preprocessing resizes in uint8 fixed point (one level
# in 255 apart at most, see test_parity.py), which moves the untrained demo network's scores a little.
REFERENCE_SCORE_TOLERANCE = 0.03
PIXEL_LEVEL = 1 / 255 / min(0.229, 0.224, 0.225)  # one uint8 level, normalised


def make_plugin(store: Path, **options: Any) -> ResNetPlugin:
    return ResNetPlugin(ResNetOptions(**{"weights": "resnet18.pt", **options}), PluginContext("classifier", store))


@pytest.fixture(scope="module")
def plugin(demo_store: Path) -> ResNetPlugin:
    loaded = make_plugin(demo_store)
    loaded.load("cpu")
    return loaded


@pytest.fixture(scope="module")
def reference(demo_store: Path) -> torch.nn.Module:
    network = torchvision.models.resnet18(weights=None)
    network.load_state_dict(torch.load(demo_store / "resnet18.pt", weights_only=True))
    return network.eval()


def run(plugin: ResNetPlugin, payloads: Sequence[Payload]) -> list[dict[str, Any]]:
    """preprocess -> one predict_batch -> postprocess, as the router does."""
    items = [plugin.preprocess(p) for p in payloads]
    outputs = plugin.predict_batch(items)
    assert len(outputs) == len(items)
    return [plugin.postprocess(output, item) for output, item in zip(outputs, items, strict=True)]


def decode_independently(payload: Payload) -> torch.Tensor:
    """uint8 RGB (3, H, W) decoded by OpenCV, not by the Pillow code under test."""
    bgr = cv2.imdecode(np.frombuffer(payload.body, np.uint8), cv2.IMREAD_COLOR)
    return torch.from_numpy(np.ascontiguousarray(bgr[..., ::-1])).permute(2, 0, 1)


def direct(reference: torch.nn.Module, payload: Payload, k: int = 5) -> list[tuple[int, float]]:
    """The torchvision recipe on one image tensor: the weights enum's own transforms, then the network."""
    image = decode_independently(payload)
    batch = torchvision.models.ResNet18_Weights.IMAGENET1K_V1.transforms()(image).unsqueeze(0)
    with torch.no_grad():
        scores, ids = reference(batch).softmax(dim=1)[0].topk(k)
    return list(zip(ids.tolist(), scores.tolist(), strict=True))


def assert_same_top_k(
    got: list[dict[str, Any]], expected: list[tuple[int, float]], tolerance: float = SCORE_TOLERANCE
) -> None:
    assert [entry["class_id"] for entry in got] == [class_id for class_id, _ in expected]
    for entry, (_, score) in zip(got, expected, strict=True):
        assert abs(entry["score"] - score) <= tolerance


@pytest.mark.parametrize("batch_size", [1, 3, 8])
def test_batched_results_match_direct_torchvision(
    plugin: ResNetPlugin, reference: torch.nn.Module, payloads: list[Payload], batch_size: int
) -> None:
    batch = payloads[:batch_size]
    for payload, answer in zip(batch, run(plugin, batch), strict=True):
        assert_same_top_k(answer["top_k"], direct(reference, payload), REFERENCE_SCORE_TOLERANCE)


def test_answers_differ_between_images(plugin: ResNetPlugin, payloads: list[Payload]) -> None:
    """The comparison above means something only if the demo network's answer depends on the image."""
    tops = {tuple(entry["class_id"] for entry in answer["top_k"]) for answer in run(plugin, payloads)}
    assert len(tops) > 1


def test_batching_never_changes_an_answer(plugin: ResNetPlugin, payloads: list[Payload]) -> None:
    assert len(payloads) == 8
    for payload, in_batch in zip(payloads, run(plugin, payloads), strict=True):
        (alone,) = run(plugin, [payload])
        expected = [(entry["class_id"], entry["score"]) for entry in alone["top_k"]]
        assert_same_top_k(in_batch["top_k"], expected)


def test_answer_shape_labels_and_json(plugin: ResNetPlugin, payloads: list[Payload]) -> None:
    (answer,) = run(plugin, payloads[:1])
    assert json.loads(json.dumps(answer)) == answer
    top = answer["top_k"]
    assert len(top) == 5 and [e["score"] for e in top] == sorted((e["score"] for e in top), reverse=True)
    categories = torchvision.models.ResNet18_Weights.IMAGENET1K_V1.meta["categories"]
    assert all(e["label"] == categories[e["class_id"]] for e in top) and 0 < top[0]["score"] <= 1


def test_preprocessing_matches_the_weights_enum_transforms(plugin: ResNetPlugin, payloads: list[Payload]) -> None:
    transforms = torchvision.models.ResNet18_Weights.IMAGENET1K_V1.transforms()
    for payload in payloads:
        expected = transforms(decode_independently(payload))
        got = plugin.preprocess(payload)
        assert isinstance(got, torch.Tensor) and got.shape == expected.shape and got.is_contiguous()
        error = (got - expected).abs()
        assert float(error.max()) <= PIXEL_LEVEL + 1e-5 and float(error.mean()) < 0.2 * PIXEL_LEVEL


def test_example_payload_and_warmup(plugin: ResNetPlugin) -> None:
    assert plugin.example_payload().media_type == "image/jpeg"
    plugin.warmup(2)


def test_memory_estimate(plugin: ResNetPlugin) -> None:
    estimate = plugin.memory_estimate()
    network = plugin._loaded()
    expected = sum(t.numel() * t.element_size() for t in [*network.parameters(), *network.buffers()])
    assert estimate.weights_bytes == expected and 44_000_000 < expected < 48_000_000  # 11.7 M fp32 params
    assert estimate.per_item_bytes > 3 * 224 * 224 * 4


def test_bad_image_is_an_input_error(plugin: ResNetPlugin) -> None:
    with pytest.raises(InputError, match="corrupt or truncated image data"):
        plugin.preprocess(Payload(b"\xff\xd8\xff\xe0garbage", "image/jpeg"))


def test_registered_under_the_resnet_entry_point() -> None:
    (point,) = [p for p in entry_points(group="model_router.plugins") if p.name == "resnet"]
    assert point.load() is ResNetPlugin
    assert PluginRegistry.from_entry_points().get("resnet").cls is ResNetPlugin


# --- custom heads and labels -----------------------------------------------------------------


@pytest.fixture(scope="module")
def three_class_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    store = tmp_path_factory.mktemp("three_class_store")
    torch.manual_seed(1)
    torch.save(torchvision.models.resnet18(weights=None, num_classes=3).state_dict(), store / "tiny.pt")
    (store / "labels.txt").write_text("cat\ndog\nbird\n\n", encoding="utf-8")
    (store / "two.txt").write_text("cat\ndog\n", encoding="utf-8")
    return store


def test_class_count_comes_from_the_state_dict_and_labels_from_the_file(
    three_class_store: Path, payloads: list[Payload]
) -> None:
    custom = make_plugin(three_class_store, weights="tiny.pt", labels_file="labels.txt", top_k=3)
    custom.load("cpu")
    (answer,) = run(custom, payloads[:1])
    assert sorted(e["label"] for e in answer["top_k"]) == ["bird", "cat", "dog"]
    assert abs(sum(e["score"] for e in answer["top_k"]) - 1) < 1e-5


@pytest.mark.parametrize("options, message", [
    ({"labels_file": "two.txt", "top_k": 2}, "labels_file 'two.txt' has 2 labels; the model has 3 classes"),
    ({"top_k": 5}, "top_k 5 is more than the model's 3 classes"),
    ({"labels_file": "missing.txt", "top_k": 1}, "labels_file 'missing.txt'"),
])
def test_labels_and_top_k_are_checked_against_the_model(
    three_class_store: Path, options: dict[str, Any], message: str
) -> None:
    with pytest.raises((ValueError, FileNotFoundError), match=message):
        make_plugin(three_class_store, weights="tiny.pt", **options).load("cpu")


# --- options and load-time validation ------------------------------------------------------------


@pytest.mark.parametrize("options, message", [
    ({"arch": "resnet19", "weights": "w.pt"}, "arch 'resnet19' is not supported; accepted: " + ", ".join(ARCHS)),
    ({"arch": "vgg16", "weights": "w.pt"}, "accepted: resnet18, resnet34, resnet50, resnet101, resnet152"),
    ({"weights": "w.pt", "top_k": 0}, "greater than or equal to 1"),
    ({"weights": "w.pt", "labels": "x.txt"}, "Extra inputs are not permitted"),
    ({}, "weights\n  Field required"),
])
def test_bad_options_are_rejected_with_a_clear_message(options: dict[str, Any], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        ResNetOptions(**options)


def test_defaults() -> None:
    options = ResNetOptions(weights="resnet18.pt")
    assert (options.arch, options.top_k, options.half, options.labels_file) == ("resnet18", 5, False, None)


@pytest.mark.parametrize("options, message", [
    ({"weights": "../resnet18.pt"}, "resolves outside the model store"),
    ({"weights": "/tmp/resnet18.pt"}, "absolute path '/tmp/resnet18.pt' is not allowed"),
    ({"labels_file": "../../etc/passwd"}, "resolves outside the model store"),
])
def test_paths_outside_the_store_are_refused_at_construction(
    demo_store: Path, options: dict[str, Any], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        make_plugin(demo_store, **options)


def test_missing_weights_fail_to_load_with_a_hint(tmp_path: Path) -> None:
    hint = r"weights file .*resnet18\.pt' not found; run `model-router store init-demo`"
    with pytest.raises(FileNotFoundError, match=hint):
        make_plugin(tmp_path).load("cpu")


def test_weights_for_another_arch_are_refused(demo_store: Path) -> None:
    with pytest.raises(ValueError, match=r"weights 'resnet18\.pt' do not fit arch 'resnet50'"):
        make_plugin(demo_store, arch="resnet50").load("cpu")


def test_a_full_pickle_is_refused_not_executed(tmp_path: Path, demo_store: Path) -> None:
    marker = tmp_path / "pwned"

    class Exploit:
        def __reduce__(self) -> tuple[Any, ...]:
            return (Path.touch, (marker,))

    torch.save({"fc.weight": torch.zeros(2, 2), "payload": Exploit()}, tmp_path / "evil.pt")
    with pytest.raises(ValueError, match=r"not a readable state dict \(torch\.load weights_only=True\)"):
        make_plugin(tmp_path, weights="evil.pt").load("cpu")
    assert not marker.exists()
    # An ultralytics checkpoint is a whole pickled model, not a state dict: refused either by
    # weights_only, or (once ultralytics has allow-listed its classes in this process) as not tensors.
    with pytest.raises(ValueError, match="not a readable state dict|does not hold a state dict of tensors"):
        make_plugin(demo_store, weights="yolov8n.pt").load("cpu")


def test_half_on_cpu_is_refused_with_the_reason(demo_store: Path) -> None:
    with pytest.raises(ValueError, match="half: true needs a CUDA device, got 'cpu'"):
        make_plugin(demo_store, half=True).load("cpu")


@pytest.mark.gpu
def test_half_on_cuda_agrees_with_fp32(demo_store: Path, payloads: list[Payload]) -> None:
    full, half = make_plugin(demo_store), make_plugin(demo_store, half=True)
    full.load("cuda:0")
    half.load("cuda:0")
    for a, b in zip(run(full, payloads), run(half, payloads), strict=True):
        assert a["top_k"][0]["class_id"] == b["top_k"][0]["class_id"]
        assert abs(a["top_k"][0]["score"] - b["top_k"][0]["score"]) < 0.01
