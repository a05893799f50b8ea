"""PluginRegistry: entry-point discovery, validation at registration, and named lookup failures."""

from __future__ import annotations

from collections.abc import Sequence
from importlib.metadata import entry_points as real_entry_points
from typing import Any

import pytest
from pydantic import BaseModel

import router.serving.registry as registry_module
from router.errors import PluginValidationError, UnknownPlugin
from router.sdk.plugin import MemoryEstimate, ModelPlugin, Payload
from router.serving.registry import ENTRY_POINT_GROUP, PluginRegistry


class EchoPlugin(ModelPlugin[Any]):
    """The smallest valid plugin."""

    def load(self, device: str) -> None:
        pass

    def preprocess(self, payload: Payload) -> Any:
        return payload.body

    def predict_batch(self, items: Sequence[Any]) -> Sequence[Any]:
        return list(items)

    def memory_estimate(self) -> MemoryEstimate:
        return MemoryEstimate(0, 0)


class HalfDone(ModelPlugin[Any]):
    def load(self, device: str) -> None:
        pass

    def preprocess(self, payload: Payload) -> Any:
        return payload.body


class PlainOptions(EchoPlugin):
    class Options:  # type: ignore[no-redef]
        pass


def with_accepts(value: object) -> type:
    return type("Accepting", (EchoPlugin,), {"accepts": value})


class FakeEntryPoint:
    """An entry point whose package fails to import."""

    name = "broken"
    dist = None

    def load(self) -> object:
        raise ImportError("No module named 'missing_dependency'")


class NotAPluginEntryPoint:
    name = "notaplugin"
    dist = None

    def load(self) -> object:
        return len


def test_entry_points_discover_plugins_from_another_distribution() -> None:
    registry = PluginRegistry.from_entry_points()

    assert {"toy", "scripted"} <= set(registry.names())
    for name in ("toy", "scripted"):
        info = registry.get(name)
        assert info.distribution == "vision-model-router-testkit"
        assert info.version == "0.2.0"
        assert info.cls.__module__.startswith("router_testkit.")
    assert not {"toy", "scripted"} & set(registry.broken)


def test_register_accepts_a_valid_plugin_class() -> None:
    registry = PluginRegistry()

    info = registry.register("echo", EchoPlugin)

    assert registry.get("echo") is info
    assert (info.cls, info.distribution, info.version) == (EchoPlugin, None, None)
    assert registry.names() == ["echo"]


@pytest.mark.parametrize(
    ("target", "fragment"),
    [
        pytest.param(lambda: None, "must name a ModelPlugin subclass", id="not-a-class"),
        pytest.param(dict, "must name a ModelPlugin subclass", id="not-a-plugin-subclass"),
        pytest.param(HalfDone, "HalfDone does not implement: memory_estimate, predict_batch", id="abstract"),
        pytest.param(PlainOptions, "Options must be a pydantic BaseModel", id="options-not-pydantic"),
        pytest.param(with_accepts(()), "accepts must be a non-empty tuple", id="accepts-empty"),
        pytest.param(with_accepts(("image",)), "accepts must be a non-empty tuple", id="accepts-no-slash"),
        pytest.param(with_accepts(["image/*"]), "accepts must be a non-empty tuple", id="accepts-list"),
        pytest.param(with_accepts(("image/*", 3)), "accepts must be a non-empty tuple", id="accepts-non-str"),
    ],
)
def test_register_rejects_unfit_plugins_at_once(target: object, fragment: str) -> None:
    registry = PluginRegistry()

    with pytest.raises(PluginValidationError) as error:
        registry.register("bad", target)

    assert error.value.plugin == "bad"
    assert fragment in str(error.value)
    assert registry.names() == []


def test_options_must_be_a_pydantic_model_and_one_is_accepted() -> None:
    class Opts(BaseModel):
        size: int = 1

    registry = PluginRegistry()

    assert registry.register("sized", type("Sized", (EchoPlugin,), {"Options": Opts})).cls.Options is Opts


def test_a_taken_name_refuses_a_different_class_but_not_the_same_one() -> None:
    registry = PluginRegistry()
    registry.register("echo", EchoPlugin)
    registry.register("echo", EchoPlugin)

    with pytest.raises(PluginValidationError, match="already registered"):
        registry.register("echo", with_accepts(("image/*",)))
    assert registry.get("echo").cls is EchoPlugin


def test_unknown_name_raises_a_key_error_listing_installed_plugins() -> None:
    registry = PluginRegistry()
    registry.register("echo", EchoPlugin)
    registry.register("other", EchoPlugin)

    with pytest.raises(KeyError) as error:
        registry.get("nosuch")

    assert isinstance(error.value, UnknownPlugin)
    assert str(error.value) == "no plugin named 'nosuch' is installed; installed plugins: echo, other"


def test_unknown_name_in_an_empty_registry_says_none() -> None:
    with pytest.raises(UnknownPlugin, match="installed plugins: none"):
        PluginRegistry().get("x")


def test_broken_entry_point_is_recorded_and_does_not_stop_others(monkeypatch: pytest.MonkeyPatch) -> None:
    def fake_entry_points(*, group: str) -> list[object]:
        return [FakeEntryPoint(), NotAPluginEntryPoint(), *real_entry_points(group=group)]

    monkeypatch.setattr(registry_module, "entry_points", fake_entry_points)

    registry = PluginRegistry.from_entry_points(ENTRY_POINT_GROUP)

    assert {"toy", "scripted"} <= set(registry.names())
    assert registry.broken["broken"] == "ImportError: No module named 'missing_dependency'"
    assert "must name a ModelPlugin subclass" in registry.broken["notaplugin"]
    with pytest.raises(UnknownPlugin) as error:
        registry.get("broken")
    assert "'broken' is installed but failed to load" in error.value.message
    assert "missing_dependency" in error.value.message


def test_registering_a_broken_name_in_code_clears_the_failure(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(registry_module, "entry_points", lambda *, group: [FakeEntryPoint()])
    registry = PluginRegistry.from_entry_points()

    registry.register("broken", EchoPlugin)

    assert registry.broken == {}
    assert registry.get("broken").cls is EchoPlugin
