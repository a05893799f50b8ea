"""One contract, every plugin this repository ships: each entry point of `model_router.plugins`
whose code lives in this repository (the bundled vision and engine plugins, the test kit's, the
docs' examples) is checked by `router.plugin_kit.check_plugin`, the checks a plugin's own package
runs with `model-router plugins check NAME` (docs/plugins.md, "Check your plugin"):

- the class loads through its entry point and passes the registry's validation; its `Options`
  validate the case's options through the fleet resolver, and an unknown option key is refused;
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

A plugin of this repository with no case below fails: add one when you add a plugin. A plugin
installed from elsewhere is its author's to check, and does not change this suite.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from importlib.metadata import entry_points
from importlib.util import find_spec
from pathlib import Path
from typing import Any

import pytest

from router.plugin_kit import check_plugin
from router.sdk import Payload

REPO = Path(__file__).resolve().parents[2]


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
    "tiny-cnn": Case({"weights": "tiny-cnn.pt", "top_k": 3}, photos, store="tiny-cnn"),
    "unsplit": Case({}, lambda _: json_payloads({"id": "a"}, {"id": "b"}, {"id": "c"}), prepares_in_a_front=False),
    "engine-hooks": Case({}, lambda _: json_payloads({"id": "a"}, {"id": "b"}, {"id": "c"})),
    "boxes": Case({"boxes": [[0, 0, 10, 10, 0.9]]}, photos),
    "pixels": Case({}, photos),
}


def shipped_here(module: str) -> bool:
    """Whether an entry point's code is in this repository (its top-level package found under it)."""
    spec = find_spec(module.split(".")[0])
    origins = [spec.origin, *(spec.submodule_search_locations or [])] if spec is not None else []
    return any(origin and Path(origin).resolve().is_relative_to(REPO) for origin in origins)


SHIPPED = sorted({point.name for point in entry_points(group="model_router.plugins") if shipped_here(point.module)})


def test_every_bundled_plugin_is_installed_and_covered() -> None:
    assert {"yolo", "resnet", "onnx", "tensorrt", "toy", "scripted", "mean-colour", "tiny-cnn", "boxes", "pixels",
            "unsplit", "engine-hooks"} <= set(SHIPPED)


@pytest.mark.parametrize("name", SHIPPED)
def test_plugin_keeps_the_contract(name: str, request: pytest.FixtureRequest, payloads: list[Payload]) -> None:
    if name not in CASES:
        pytest.fail(f"plugin {name!r} has no contract case: add one to CASES in {__file__}")
    case = CASES[name]
    store: Path = request.getfixturevalue({"demo": "demo_store", "onnx": "onnx_store", "tiny-cnn": "tiny_cnn_store"}[case.store])
    if case.store == "onnx":
        request.getfixturevalue("exports")
    report = check_plugin(name, options=case.options, inputs=case.inputs(payloads), store=store,
                          refuses=not case.loads_on_cpu, front_process=case.prepares_in_a_front)
    assert (report.refusal is None) == case.loads_on_cpu, report
    assert report.steps[-1] == "unload" or not case.loads_on_cpu, report.steps
