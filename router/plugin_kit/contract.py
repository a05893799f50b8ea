"""The plugin contract as checks a plugin's own package runs against itself: by
`model-router plugins check NAME`, by the pytest helper (`check_plugin`, the `plugin_contract`
fixture) and by the router's own contract test, one implementation for all three.

The plugin is loaded through its entry point, as `serve` loads it, and checked step by step;
the first step that fails raises ContractFailure naming the plugin, the step and why.
"""

from __future__ import annotations

import json
import math
import pickle
import tempfile
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from fnmatch import fnmatch
from pathlib import Path
from typing import Any

from router.config import FleetConfig
from router.errors import ConfigError
from router.host.packing import Packer, unpack
from router.sdk import MemoryEstimate, ModelPlugin, Payload, PluginContext, example_jpeg
from router.serving.plan import resolve_fleet
from router.serving.registry import PluginRegistry

__all__ = ["MODEL", "ContractFailure", "ContractReport", "check_plugin", "distance", "sample_inputs"]

MODEL = "contract"  # the model name the checked plugin is given: load errors must name it
#: (width, height, seed) of the inputs derived for a plugin that accepts JPEG: three different photos.
SAMPLE_IMAGES = ((320, 240, 1), (480, 640, 2), (517, 333, 3))


class ContractFailure(AssertionError):
    """A plugin broke the contract: which plugin, at which step, and why."""

    def __init__(self, plugin: str, step: str, reason: str) -> None:
        super().__init__(f"plugin {plugin!r} breaks the contract at {step}: {reason}")
        self.plugin, self.step, self.reason = plugin, step, reason


@dataclass
class ContractReport:
    """What was checked, in order, one line a step; `refusal` is the load error of a plugin that refused the device."""

    plugin: str
    device: str
    distribution: str | None = None
    steps: list[str] = field(default_factory=list)
    refusal: str | None = None


def check_plugin(name: str, *, options: dict[str, Any] | None = None, inputs: Sequence[Payload] | None = None,
                 store: Path | str | None = None, device: str = "cpu", refuses: bool = False,
                 front_process: bool = True) -> ContractReport:
    """Run the contract over the installed plugin `name` and return what passed; raise ContractFailure.

    `options`: the model's `options:` (default none); `inputs`: payloads it accepts, each different
    (default: three generated photos when it accepts JPEG, else its example payload); `store`: the
    model store its options name files in (default: an empty directory); `refuses`: the plugin is
    expected to refuse `device`, with an error that names the model; `front_process=False` skips the
    split-host check, for a plugin written before the split (a split host serves it from the engine)."""
    with _store(store) as root:
        return _Check(name, dict(options or {}), root, device).run(inputs, refuses, front_process)


@contextmanager
def _store(store: Path | str | None) -> Iterator[Path]:
    if store is not None:
        yield Path(store)
        return
    with tempfile.TemporaryDirectory(prefix="plugin-contract-") as empty:
        yield Path(empty)


class _Check:
    def __init__(self, name: str, options: dict[str, Any], store: Path, device: str) -> None:
        self.name, self.options, self.store, self.device = name, options, store, device
        self.report = ContractReport(name, device)

    def fail(self, step: str, reason: str) -> ContractFailure:
        return ContractFailure(self.name, step, reason)

    def passed(self, line: str) -> None:
        self.report.steps.append(line)

    def run(self, given: Sequence[Payload] | None, refuses: bool, front_process: bool) -> ContractReport:
        cls = self.plugin_class()
        options = self.resolved_options()
        plugin: ModelPlugin[Any] = self.step("the constructor", lambda: cls(options, PluginContext(MODEL, self.store)))
        if not self.loaded(plugin, refuses):
            return self.report
        try:
            inputs = self.inputs(cls, plugin, given)  # after load: example_payload() may need the loaded model
            self.memory_estimate(plugin)
            self.warmup(cls, plugin)
            self.round_trip(plugin, inputs)
            if front_process:
                self.front_process(cls, options, plugin, inputs)
        finally:
            plugin.unload()
        self.passed("unload")
        return self.report

    def plugin_class(self) -> type[ModelPlugin[Any]]:
        registry = PluginRegistry.from_entry_points(only={self.name})
        if self.name in registry.broken:
            raise self.fail("the entry point", registry.broken[self.name])
        if self.name not in registry.names():
            installed = ", ".join(registry.installed()) or "none"
            raise self.fail("the entry point", f"no plugin of that name in the group model_router.plugins "
                                               f"(installed: {installed}); is its distribution installed?")
        info = registry.get(self.name)
        self.report.distribution = info.distribution
        self.passed(f"entry point: {info.cls.__module__}.{info.cls.__qualname__} from {info.distribution or 'no distribution'}"
                    ", a valid ModelPlugin class (Options, accepts, every abstract hook)")
        return info.cls

    def resolved_options(self) -> Any:
        """The options through the fleet resolver, as `serve` resolves them; a misspelt key beside them is refused."""
        registry = PluginRegistry.from_entry_points(only={self.name})

        def resolve(given: dict[str, Any]) -> Any:
            fleet = FleetConfig.model_validate({"model_store": str(self.store),
                                                "models": {MODEL: {"plugin": self.name, "options": given}}})
            return resolve_fleet(fleet, registry, "contract").models[MODEL].options

        try:
            options = resolve(self.options)
        except ConfigError as exc:
            raise self.fail("the options", f"{self.options} are refused: {exc}") from exc
        try:
            resolve({**self.options, "no_such_option": 1})
        except ConfigError as exc:
            if "no_such_option" not in str(exc):
                raise self.fail("the options", f"an unknown key is refused without naming it: {exc}") from exc
        else:
            raise self.fail("the options", "an unknown key (no_such_option) is accepted: give Options extra='forbid'")
        self.passed(f"options: {self.options} validated, an unknown key refused")
        return options

    def inputs(self, cls: type[ModelPlugin[Any]], plugin: ModelPlugin[Any], given: Sequence[Payload] | None) -> list[Payload]:
        inputs = list(given) if given is not None else self.step("example_payload()", lambda: sample_inputs(cls, plugin))
        if not inputs:
            raise self.fail("the inputs", f"none given, and none can be made for accepts={cls.accepts}: "
                                          "give inputs (--input FILE) or an example_payload()")
        refused = [payload.media_type for payload in inputs if not accepts(cls, payload)]
        if refused:
            raise self.fail("the inputs", f"{refused} not in accepts={cls.accepts}")
        self.passed(f"inputs: {len(inputs)} ({', '.join(p.media_type for p in inputs)}), each within accepts")
        return inputs

    def loaded(self, plugin: ModelPlugin[Any], refuses: bool) -> bool:
        """Load on the device; a refusal must name the model. False when it refused, as expected."""
        try:
            plugin.load(self.device)
        except Exception as exc:  # a fault boundary around the plugin: a plugin's load error is what this step reports
            message = f"{type(exc).__name__}: {exc}"
            if f"model {MODEL!r}" not in str(exc):
                raise self.fail(f"load({self.device!r})", f"{message} (a load error must name the model: "
                                                          f"model {MODEL!r}, from self.context.model_name)") from exc
            if not refuses:
                raise self.fail(f"load({self.device!r})", message) from exc
            self.report.refusal = message
            self.passed(f"load({self.device!r}) refused, naming the model: {message}")
            return False
        if refuses:
            plugin.unload()
            raise self.fail(f"load({self.device!r})", "loaded, but the plugin was expected to refuse this device")
        self.passed(f"load({self.device!r})")
        return True

    def memory_estimate(self, plugin: ModelPlugin[Any]) -> None:
        estimate = self.step("memory_estimate()", plugin.memory_estimate)
        if not isinstance(estimate, MemoryEstimate):
            raise self.fail("memory_estimate()", f"returns {estimate!r}, not a MemoryEstimate")
        figures = {"weights_bytes": estimate.weights_bytes, "per_item_bytes": estimate.per_item_bytes,
                   "fixed_bytes": estimate.fixed_bytes}
        bad = {key: n for key, n in figures.items() if not (isinstance(n, int) and not isinstance(n, bool) and n >= 0)}
        if bad:
            raise self.fail("memory_estimate()", f"figures must be non-negative integers of bytes, got {bad}")
        if estimate.source != "estimate":
            raise self.fail("memory_estimate()", f"source is {estimate.source!r}: leave it 'estimate'")
        self.passed(f"memory_estimate(): {figures}")

    def warmup(self, cls: type[ModelPlugin[Any]], plugin: ModelPlugin[Any]) -> None:
        example = self.step("example_payload()", plugin.example_payload)
        if example is None:
            self.passed("warm-up: no example_payload(), nothing to warm up with")
            return
        if not accepts(cls, example):
            raise self.fail("example_payload()", f"its {example.media_type} is not in accepts={cls.accepts}")
        self.step("warmup(2)", lambda: plugin.warmup(2))
        self.passed("warm-up: warmup(2) with the example payload")

    def round_trip(self, plugin: ModelPlugin[Any], inputs: list[Payload]) -> None:
        """preprocess -> predict_batch -> postprocess: one JSON answer per input, each the input's own."""
        items = [self.step("preprocess", lambda p=payload: plugin.preprocess(p)) for payload in inputs]
        outputs = self.step("predict_batch", lambda: list(plugin.predict_batch(items)))
        if len(outputs) != len(items):
            raise self.fail("predict_batch", f"{len(outputs)} outputs for a batch of {len(items)}")
        answers = [self.answer(plugin, output, item) for output, item in zip(outputs, items, strict=True)]
        alone = [self.answer(plugin, self.step("predict_batch", lambda i=item: plugin.predict_batch([i]))[0], item)
                 for item in items]
        for index, answer in enumerate(answers):
            nearest = min(distance(answer, other) for other in alone)
            if distance(answer, alone[index]) > nearest:
                raise self.fail("predict_batch", f"the batch's answer {index} is nearer another input's answer run "
                                                 "alone than its own: outputs must follow the items' order")
        for payload, item in zip(inputs, items, strict=True):
            self.json_answer("describe_input", self.step("describe_input", lambda p=payload, i=item: plugin.describe_input(p, i)))
        self.passed(f"round trip: a batch of {len(items)} gives {len(items)} JSON answers, in order (as each run alone)")

    def answer(self, plugin: ModelPlugin[Any], output: Any, item: Any) -> Any:
        return self.json_answer("postprocess", self.step("postprocess", lambda: plugin.postprocess(output, item)))

    def json_answer(self, step: str, answer: Any) -> Any:
        try:
            json.dumps(answer, allow_nan=False)
        except (TypeError, ValueError) as exc:
            raise self.fail(step, f"returns what is not plain JSON without NaN ({exc}): {answer!r:.200}") from exc
        return answer

    def front_process(self, cls: type[ModelPlugin[Any]], options: Any, loaded: ModelPlugin[Any],
                      inputs: list[Payload]) -> None:
        """Split into processes, a constructed object takes the loaded one's front_state() and prepares as it does."""
        if cls.preprocess_needs_model:
            self.passed("front process: preprocess_needs_model, its hooks run beside the model")
            return
        front = cls(options, PluginContext(MODEL, self.store))
        state = self.step("front_state", lambda: pickle.loads(pickle.dumps(loaded.front_state(), protocol=5)))
        self.step("adopt_front_state", lambda: front.adopt_front_state(state))
        for payload in inputs:
            item = self.step("preprocess in a front", lambda p=payload: front.preprocess(p))
            packed, _ = self.step("packing an item", lambda i=item: Packer(None).pack(i))
            output = loaded.predict_batch([unpack(packed, None)])[0]  # the item as the engine receives it
            here = front.postprocess(unpack(Packer(None).pack(output)[0], None), item)
            there = loaded.postprocess(output, loaded.preprocess(payload))
            if distance(here, there) != 0:
                raise self.fail("postprocess in a front", f"answers {here!r:.200}, the loaded object {there!r:.200}")
            self.json_answer("describe_input", front.describe_input(payload, item))
        self.passed("front process: front_state() adopted by a constructed object, same answers across the packing")

    def step(self, step: str, call: Callable[[], Any]) -> Any:
        try:
            return call()
        except ContractFailure:
            raise
        except Exception as exc:  # a fault boundary around the plugin: a plugin's error is what this step reports
            raise self.fail(step, f"{type(exc).__name__}: {exc}") from exc


def sample_inputs(cls: type[ModelPlugin[Any]], plugin: ModelPlugin[Any]) -> list[Payload]:
    """Inputs for a plugin that gave none: three different photos if it accepts JPEG, else its example payload."""
    jpegs = [example_jpeg(width, height, seed=seed) for width, height, seed in SAMPLE_IMAGES]
    if accepts(cls, jpegs[0]):
        return jpegs
    example = plugin.example_payload()
    return [example] if example is not None else []


def accepts(cls: type[ModelPlugin[Any]], payload: Payload) -> bool:
    media = payload.media_type.split(";", 1)[0].strip().lower()
    return any(fnmatch(media, pattern) for pattern in cls.accepts)


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
