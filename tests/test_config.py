"""Fleet parsing (router/config.py), plugin resolution (router/serving/plan.py), `model-router check`, ServerSettings."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pydantic import BaseModel, Field, ValidationError

from router.cli import main
from router.config import BatchPolicy, DeviceConfig, QueueConfig, ServerSettings, load_fleet, nesting_exceeds
from router.errors import ConfigError
from router.serving.plan import option_keys, resolve_fleet
from router.serving.registry import PluginRegistry
from tests.test_registry import EchoPlugin

MINIMAL = "models:\n  m:\n    plugin: scripted\n"


def write(tmp_path: Path, text: str, name: str = "fleet.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def config_error(path: Path) -> str:
    with pytest.raises(ConfigError) as error:
        load_fleet(path)
    return str(error.value)


def plan_error(path: Path) -> str:
    with pytest.raises(ConfigError) as error:
        resolve_fleet(load_fleet(path), PluginRegistry.from_entry_points(), str(path))
    return str(error.value)


def test_minimal_fleet_parses_with_defaults(tmp_path: Path) -> None:
    fleet = load_fleet(write(tmp_path, MINIMAL))

    model = fleet.models["m"]
    assert model.instance_devices == ["cpu"]
    assert model.queue == QueueConfig()
    assert model.batch == BatchPolicy(max_size=8, max_delay_ms=5.0)
    assert model.options == {}
    assert fleet.devices == {"cpu": DeviceConfig()}
    assert fleet.model_store == (tmp_path / "model_store").resolve()


def test_device_and_devices_forms_give_instance_devices(tmp_path: Path) -> None:
    text = "models:\n  one:\n    plugin: scripted\n    device: cuda:0\n" \
           "  two:\n    plugin: scripted\n    devices: [cpu, cuda:1]\n"

    fleet = load_fleet(write(tmp_path, text))

    assert fleet.models["one"].instance_devices == ["cuda:0"]
    assert fleet.models["two"].instance_devices == ["cpu", "cuda:1"]


def test_undeclared_devices_get_defaults_and_declared_keep_their_settings(tmp_path: Path) -> None:
    text = "devices:\n  cuda:0:\n    memory_budget: 2GiB\n    high_watermark: 0.95\n" \
           "models:\n  m:\n    plugin: scripted\n    devices: [cuda:0, cuda:1]\n"

    fleet = load_fleet(write(tmp_path, text))

    assert set(fleet.devices) == {"cuda:0", "cuda:1"}
    assert fleet.devices["cuda:0"].memory_budget == 2 * 1024**3
    assert fleet.devices["cuda:0"].high_watermark == 0.95
    assert fleet.devices["cuda:1"] == DeviceConfig()


@pytest.mark.parametrize(("text", "nbytes"), [("2GiB", 2 * 1024**3), ("512MB", 512_000_000), ("1024", 1024)])
def test_byte_sizes_accept_units(tmp_path: Path, text: str, nbytes: int) -> None:
    fleet = load_fleet(write(tmp_path, f"models:\n  m:\n    plugin: scripted\n    memory:\n      budget: {text}\n"))

    assert fleet.models["m"].memory.budget == nbytes




@pytest.mark.parametrize(
    ("text", "fragments"),
    [
        pytest.param(
            MINIMAL + "    batch:\n      max_size: 0\n",
            ["models.m.batch.max_size:", "(got 0)", "greater than or equal to 1"],
            id="batch-size-zero",
        ),
        pytest.param(
            MINIMAL + "    device: gpu0\n",
            ["models.m.device:", "'gpu0'", "accepted: 'cpu' or 'cuda:N'"],
            id="bad-device",
        ),
        pytest.param(
            MINIMAL + "    device: cpu\n    devices: [cpu]\n",
            ["models.m:", "give either device or devices"],
            id="device-and-devices",
        ),
        pytest.param(
            "devices:\n  gpu0: {}\n" + MINIMAL,
            ["devices:", "'gpu0'", "accepted: 'cpu' or 'cuda:N'"],
            id="bad-device-name",
        ),
        pytest.param(
            "devices:\n  cpu:\n    low_watermark: 0.95\n    high_watermark: 0.9\n" + MINIMAL,
            ["devices.cpu:", "low_watermark 0.95", "high_watermark 0.9", "accepted: low_watermark <= high_watermark"],
            id="watermarks-inverted",
        ),
        pytest.param(
            "colour: blue\n" + MINIMAL,
            ["colour:", "(got 'blue')", "models"],
            id="unknown-top-level-key",
        ),
        pytest.param(
            "models:\n  my model:\n    plugin: scripted\n",
            ["models:", "'my model'", "accepted: letters, digits"],
            id="model-name-with-space",
        ),
        pytest.param("models: {}\n", ["models:", "no models", "add at least one"], id="no-models"),
        pytest.param("- a\n- b\n", ["expected a mapping with 'models'", "got list"], id="not-a-mapping"),
        pytest.param("", ["expected a mapping with 'models'", "got NoneType"], id="empty-file"),
        pytest.param("models: [\n", ["not valid YAML", "line 2"], id="invalid-yaml"),
        pytest.param(
            MINIMAL + "    memory:\n      budget: lots\n",
            ["models.m.memory.budget:", "(got 'lots')", "byte string"],
            id="bad-byte-size",
        ),
        pytest.param(
            MINIMAL + "    queue:\n      priority_levels: 2\n      default_priority: 3\n",
            ["models.m.queue:", "default_priority 3", "accepted: 1..2"],
            id="default-priority-above-levels",
        ),
    ],
)
def test_config_errors_name_file_key_value_and_accepted(tmp_path: Path, text: str, fragments: list[str]) -> None:
    path = write(tmp_path, text)

    message = config_error(path)

    for fragment in [str(path), *fragments]:
        assert fragment in message


def test_missing_file_error_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "absent.yaml"

    message = config_error(path)

    assert str(path) in message
    assert "cannot read fleet file" in message


def test_every_problem_is_reported_together(tmp_path: Path) -> None:
    text = "models:\n  a:\n    plugin: scripted\n    batch:\n      max_size: 0\n" \
           "  b:\n    plugin: scripted\n    weight: -1\n"

    message = config_error(write(tmp_path, text))

    assert "2 problem(s)" in message
    assert "models.a.batch.max_size" in message
    assert "models.b.weight" in message


def test_unknown_plugin_lists_installed_plugins(tmp_path: Path) -> None:
    path = write(tmp_path, "models:\n  m:\n    plugin: nosuch\n")

    message = plan_error(path)

    assert f"{path}: models.m.plugin:" in message
    assert "(got 'nosuch')" in message
    assert "installed plugins:" in message
    assert "scripted" in message and "toy" in message


def test_plugin_options_are_validated_against_the_plugins_options_model(tmp_path: Path) -> None:
    path = write(tmp_path, MINIMAL + "    options:\n      fixed_ms: -1\n      colour: red\n")

    message = plan_error(path)

    assert "2 problem(s)" in message
    assert f"{path}: models.m.options.fixed_ms: Input should be greater than or equal to 0 (got -1)" in message
    assert f"{path}: models.m.options.colour:" in message
    assert "(got 'red')" in message


def test_valid_options_resolve_to_the_plugins_options_model(tmp_path: Path) -> None:
    path = write(tmp_path, MINIMAL + "    options:\n      fixed_ms: 5\n")

    plan = resolve_fleet(load_fleet(path), PluginRegistry.from_entry_points(), str(path))

    model = plan.models["m"]
    assert model.plugin.name == "scripted"
    assert isinstance(model.options, model.plugin.cls.Options)
    assert model.options.fixed_ms == 5.0  # type: ignore[attr-defined]


def test_check_prints_the_plan_as_json_and_exits_zero(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write(tmp_path, MINIMAL + "    batch:\n      max_size: 4\n")

    code = main(["check", "--config", str(path)])

    out, err = capsys.readouterr()
    assert code == 0
    described = json.loads(out)
    assert described["source"] == str(path)
    assert described["models"]["m"]["plugin"] == "scripted"
    assert described["models"]["m"]["batch"]["max_size"] == 4
    assert described["models"]["m"]["distribution"].startswith("vision-model-router-testkit")
    assert "is valid" in err


def test_check_prints_the_error_to_stderr_and_exits_nonzero(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write(tmp_path, MINIMAL + "    batch:\n      max_size: 0\n")

    code = main(["check", "--config", str(path)])

    out, err = capsys.readouterr()
    assert code != 0
    assert out == ""
    assert f"{path}: models.m.batch.max_size:" in err


def test_check_reports_unknown_plugins(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write(tmp_path, "models:\n  m:\n    plugin: nosuch\n")

    code = main(["check", "--config", str(path)])

    assert code != 0
    assert "no plugin named 'nosuch'" in capsys.readouterr().err


def test_server_settings_read_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MODEL_ROUTER_PORT", "9123")
    monkeypatch.setenv("MODEL_ROUTER_CONFIG", "/srv/fleet.yaml")
    monkeypatch.setenv("MODEL_ROUTER_HOST", "0.0.0.0")

    settings = ServerSettings()

    assert (settings.port, settings.config, settings.host) == (9123, Path("/srv/fleet.yaml"), "0.0.0.0")


def test_server_settings_defaults_without_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("MODEL_ROUTER_PORT", "MODEL_ROUTER_CONFIG", "MODEL_ROUTER_HOST"):
        monkeypatch.delenv(name, raising=False)

    settings = ServerSettings()

    assert (settings.port, settings.config, settings.host) == (8000, Path("config/fleet.yaml"), "127.0.0.1")


def test_server_settings_reject_bad_port(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MODEL_ROUTER_PORT", "70000")

    with pytest.raises(ValidationError, match="port"):
        ServerSettings()


def test_grpc_port_defaults_to_8001_and_must_differ_from_the_http_port(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("MODEL_ROUTER_PORT", "MODEL_ROUTER_GRPC_PORT"):
        monkeypatch.delenv(name, raising=False)
    assert (ServerSettings().grpc_port, ServerSettings(grpc_port=0).grpc_port) == (8001, 0)
    with pytest.raises(ValidationError, match="grpc_port 9000 is the HTTP port too; give gRPC another port, or 0"):
        ServerSettings(port=9000, grpc_port=9000)
    assert ServerSettings(port=0, grpc_port=0).port == 0  # both off or chosen by the system: no clash


class LaxOptions(BaseModel):
    """Options without extra="forbid": pydantic alone would drop an unknown key without a word."""

    size: int = 1
    label: str = Field("x", alias="name")


class LaxPlugin(EchoPlugin):
    Options = LaxOptions


def lax_registry() -> PluginRegistry:
    registry = PluginRegistry()
    registry.register("lax", LaxPlugin)
    return registry


def test_unknown_option_keys_are_refused_whatever_the_options_model_says(tmp_path: Path) -> None:
    path = write(tmp_path, "models:\n  m:\n    plugin: lax\n    options: {size: 2, szie: 3}\n")

    with pytest.raises(ConfigError) as error:
        resolve_fleet(load_fleet(path), lax_registry(), str(path))

    assert str(error.value).splitlines() == [
        f"{path}: models.m.options.szie: unknown key; accepted: size, name (got 3)",
    ]


def test_unknown_option_keys_are_reported_with_the_other_option_errors(tmp_path: Path) -> None:
    path = write(tmp_path, MINIMAL + "    options: {fixed_ms: -1, fixed_sm: 5}\n")

    lines = plan_error(path).splitlines()

    assert lines[0].endswith("invalid configuration (2 problem(s))")
    unknown = [line for line in lines if "models.m.options.fixed_sm: unknown key; accepted: fixed_ms, per_item_ms," in line]
    assert len(unknown) == 1 and unknown[0].endswith("(got 5)"), lines
    assert any("models.m.options.fixed_ms: Input should be greater than or equal to 0 (got -1)" in line for line in lines)


def test_option_aliases_are_the_keys_the_options_model_reads(tmp_path: Path) -> None:
    path = write(tmp_path, "models:\n  m:\n    plugin: lax\n    options: {name: y}\n")
    assert option_keys(LaxOptions) == ["size", "name"]

    plan = resolve_fleet(load_fleet(path), lax_registry(), str(path))

    assert plan.models["m"].options == LaxOptions(size=1, name="y")


@pytest.mark.parametrize(("text", "fragment"), [
    ('models:\n  "m\\n": {plugin: scripted}\n', "model name 'm\\n' is not valid"),  # `$` matched before it
    ("models:\n  m: {plugin: scripted, devices: [" + ", ".join(["cpu"] * 65) + "]}\n", "at most 64 items"),
    ("models:\n  m: {plugin: scripted, options: {a: " + "[" * 40 + "]" * 40 + "}}\n", "more than 32 levels deep"),
    ("models:\n  m: {plugin: scripted, options: {a: " + "[" * 50_000 + "]" * 50_000 + "}}\n",
     "more than 32 levels deep"),  # deeper than Python's recursion limit
])
def test_unbounded_fleet_files_are_refused(tmp_path: Path, text: str, fragment: str) -> None:
    assert fragment in config_error(write(tmp_path, text))


def test_a_fleet_file_that_is_not_utf8_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "fleet.yaml"
    path.write_bytes(MINIMAL.encode() + b"# caf\xe9\n")
    assert config_error(path) == f"{path}: not UTF-8 text (byte {len(MINIMAL) + 5} is 0xe9)"


def test_nesting_is_measured_once_per_shared_container() -> None:
    """A YAML alias bomb: nine levels of lists each referencing the one below nine times (9**9 leaves)."""
    level: list[object] = ["x"]
    for _ in range(9):
        level = [level] * 9
    assert not nesting_exceeds(level, 10)
    assert nesting_exceeds(level, 9)
