"""One contract, every installed plugin: each entry point of `model_router.plugins` (the bundled
vision and engine plugins, the test kit's, the docs' example, and anything else installed) is
checked the same way, as docs/plugins.md describes it:

- the class passes the registry's validation; its `Options` validate the case's options through
  the fleet resolver, and an unknown option key is refused;
- `accepts` covers the inputs and the example payload;
- `load` on the CPU works (or, for a plugin that cannot run here, fails naming the model);
- `memory_estimate` is a MemoryEstimate of non-negative integers;
- `preprocess` -> `predict_batch` -> `postprocess` gives one answer per input, in order (each
  answer is nearest to the same input's answer run alone), and every answer is JSON without NaN;
- warm-up with the example payload, `describe_input` and `unload` run;
- split into processes (`workers: N`), an object that was only constructed, as a front process
  has it, takes the loaded object's `front_state()` (pickled, as between processes) and then
  preprocesses and postprocesses as the loaded one does, its items crossing to the loaded one
  as they cross to the engine; unless the plugin says `preprocess_needs_model`.

A plugin with no case below fails: add one when you add a plugin.
"""

from __future__ import annotations

import json
import math
import pickle
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from fnmatch import fnmatch
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

import pytest

from router.config import FleetConfig
from router.errors import ConfigError
from router.host.packing import Packer, unpack
from router.sdk import MemoryEstimate, ModelPlugin, Payload, PluginContext
from router.serving.plan import resolve_fleet
from router.serving.registry import PluginRegistry, validate_plugin_class


def json_payloads(*documents: dict[str, Any]) -> list[Payload]:
    return [Payload(json.dumps(document).encode(), "application/json") for document in documents]


@dataclass(frozen=True)
class Case:
    options: dict[str, Any]
    inputs: Callable[[list[Payload]], list[Payload]]  # three different inputs, from the session's photos
    store: str = "demo"  # "demo": the demo checkpoints; "onnx": the ONNX exports of them
    loads_on_cpu: bool = True
    prepares_in_a_front: bool = True  # False: a plugin written before the split (a split host serves it from the engine)


def photos(payloads: list[Payload]) -> list[Payload]:
    return payloads[:3]  # 320x240 JPEG, 480x640 PNG, 517x333 JPEG


CASES = {
    "yolo": Case({"model": "yolov8n.pt", "imgsz": 320, "conf": 0.1}, photos),
    "resnet": Case({"weights": "resnet18.pt"}, photos),
    "onnx": Case({"model": "resnet18.onnx"}, photos, store="onnx"),
    "tensorrt": Case({"engine": "resnet18.engine"}, photos, store="onnx", loads_on_cpu=False),
    "toy": Case({"seed": 3}, lambda _: json_payloads(*({"x": [float(i * k) for k in range(16)]} for i in (1, -2, 3)))),
    "scripted": Case({}, lambda _: json_payloads({"id": "a"}, {"id": "b"}, {"id": "c"})),
    "mean-colour": Case({"decimals": 2}, photos),
    "unsplit": Case({}, lambda _: json_payloads({"id": "a"}, {"id": "b"}, {"id": "c"}), prepares_in_a_front=False),
    "engine-hooks": Case({}, lambda _: json_payloads({"id": "a"}, {"id": "b"}, {"id": "c"})),
    "boxes": Case({"boxes": [[0, 0, 10, 10, 0.9]]}, photos),
    "pixels": Case({}, photos),
}

INSTALLED = sorted(point.name for point in entry_points(group="model_router.plugins"))


def test_every_bundled_plugin_is_installed_and_covered() -> None:
    assert {"yolo", "resnet", "onnx", "tensorrt", "toy", "scripted", "mean-colour", "boxes", "pixels", "unsplit",
            "engine-hooks"} <= set(INSTALLED)


@pytest.mark.parametrize("name", INSTALLED)
def test_plugin_keeps_the_contract(name: str, request: pytest.FixtureRequest, payloads: list[Payload]) -> None:
    if name not in CASES:
        pytest.fail(f"plugin {name!r} has no contract case: add one to CASES in {__file__}")
    case = CASES[name]
    store: Path = request.getfixturevalue("demo_store")
    if case.store == "onnx":
        request.getfixturevalue("exports")
        store = request.getfixturevalue("onnx_store")
    cls = PluginRegistry.from_entry_points(only={name}).get(name).cls
    validate_plugin_class(name, cls)
    options = resolved_options(name, case.options, store)
    assert isinstance(options, cls.Options)
    inputs = case.inputs(payloads)
    assert all(accepts(cls, payload) for payload in inputs), (cls.accepts, [p.media_type for p in inputs])

    plugin: ModelPlugin[Any] = cls(options, PluginContext("m", store))
    if not case.loads_on_cpu:
        with pytest.raises(Exception, match="model 'm'"):
            plugin.load("cpu")
        return
    plugin.load("cpu")
    try:
        check_memory_estimate(plugin.memory_estimate())
        example = plugin.example_payload()
        if example is not None:
            assert accepts(cls, example), f"the example payload's {example.media_type} is not in {cls.accepts}"
            plugin.warmup(2)
        check_round_trip(plugin, inputs)
        if case.prepares_in_a_front:
            check_front_process(cls, options, store, plugin, inputs)
    finally:
        plugin.unload()


def resolved_options(name: str, options: dict[str, Any], store: Path) -> Any:
    """The case's options through the fleet resolver; a misspelt key beside them is refused."""
    registry = PluginRegistry.from_entry_points(only={name})

    def resolve(given: dict[str, Any]) -> Any:
        fleet = FleetConfig.model_validate({"model_store": str(store), "models": {"m": {"plugin": name, "options": given}}})
        return resolve_fleet(fleet, registry, "contract").models["m"].options

    with pytest.raises(ConfigError, match=r"models\.m\.options\.no_such_option: unknown key"):
        resolve({**options, "no_such_option": 1})
    return resolve(options)


def accepts(cls: type[ModelPlugin[Any]], payload: Payload) -> bool:
    media = payload.media_type.split(";", 1)[0].strip().lower()
    return any(fnmatch(media, pattern) for pattern in cls.accepts)


def check_memory_estimate(estimate: MemoryEstimate) -> None:
    assert isinstance(estimate, MemoryEstimate)
    figures = (estimate.weights_bytes, estimate.per_item_bytes, estimate.fixed_bytes)
    assert all(isinstance(n, int) and n >= 0 for n in figures), figures
    assert estimate.source == "estimate"


def check_round_trip(plugin: ModelPlugin[Any], inputs: list[Payload]) -> None:
    items = [plugin.preprocess(payload) for payload in inputs]
    outputs = plugin.predict_batch(items)
    assert len(outputs) == len(items), f"{len(outputs)} outputs for a batch of {len(items)}"
    answers = [plugin.postprocess(output, item) for output, item in zip(outputs, items, strict=True)]
    for answer in answers:
        json.dumps(answer, allow_nan=False)  # plain JSON types, no NaN or infinity
    alone = [plugin.postprocess(plugin.predict_batch([item])[0], item) for item in items]
    order = [min(range(len(alone)), key=lambda k: distance(answer, alone[k])) for answer in answers]
    assert order == list(range(len(items))), f"batch answers match the inputs run alone in the order {order}"
    for payload, item in zip(inputs, items, strict=True):
        json.dumps(plugin.describe_input(payload, item), allow_nan=False)


def check_front_process(cls: type[ModelPlugin[Any]], options: Any, store: Path, loaded: ModelPlugin[Any],
                        inputs: list[Payload]) -> None:
    if cls.preprocess_needs_model:
        return  # its hooks run in the engine, beside the model
    front = cls(options, PluginContext("m", store))
    front.adopt_front_state(pickle.loads(pickle.dumps(loaded.front_state(), protocol=5)))
    for payload in inputs:
        item = front.preprocess(payload)
        packed, _ = Packer(None).pack(item)
        output = loaded.predict_batch([unpack(packed, None)])[0]  # the item as the engine receives it
        here = front.postprocess(unpack(Packer(None).pack(output)[0], None), item)
        there = loaded.postprocess(output, loaded.preprocess(payload))
        assert distance(here, there) == 0, (here, there)
        json.dumps(front.describe_input(payload, item), allow_nan=False)


def distance(a: Any, b: Any) -> float:
    """How different two JSON answers are: relative number differences, 1 per other mismatch."""
    if isinstance(a, dict) and isinstance(b, dict):
        return sum(distance(a.get(key), b.get(key)) for key in a.keys() | b.keys())
    if isinstance(a, Sequence) and isinstance(b, Sequence) and not isinstance(a, str) and not isinstance(b, str):
        return sum(distance(x, y) for x, y in zip(a, b)) + abs(len(a) - len(b))
    numbers = (int, float)
    if isinstance(a, numbers) and isinstance(b, numbers) and not isinstance(a, bool) and not isinstance(b, bool):
        return 0.0 if a == b else abs(a - b) / (abs(a) + abs(b)) if math.isfinite(a - b) else 1.0
    return 0.0 if a == b else 1.0
