"""`model-router export` without any real exporter (router/exporting.py): which exporters a format
runs and in what order, what each is handed, what happens when one cannot run here, and the
checks an exporter class passes when it is discovered."""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar

import pytest

from router.errors import PluginValidationError
from router.exporting import check_exporter, export_steps, run_export, source_model
from router.sdk import Exporter, ExportError, ExportJob, PluginContext, SourceModel
from router.serving.registry import Discovered, Entry
from tests.test_registry import EchoPlugin


class FakeExporter(Exporter):
    """Writes `<format>` text; records the jobs it was given."""

    blocked: ClassVar[list[str]] = []

    def __init__(self) -> None:
        self.jobs: list[ExportJob] = []

    def problems(self, device: str) -> list[str]:
        return list(self.blocked)

    def export(self, job: ExportJob) -> Path:
        self.jobs.append(job)
        job.out.write_text(self.format, encoding="utf-8")
        job.progress(f"wrote {job.out.name}")
        return job.out


class Onnx(FakeExporter):
    format, title, suffix = "onnx", "ONNX model", ".onnx"


class Engine(FakeExporter):
    format, title, suffix, needs = "engine", "engine", ".engine", "onnx"


class BlockedEngine(Engine):
    blocked: ClassVar[list[str]] = ["no GPU here"]


def found(*exporters: Exporter, broken: dict[str, str] | None = None) -> Discovered[Exporter]:
    return Discovered(entries={e.format: Entry(e.format, e) for e in exporters}, broken=broken or {})


def source(tmp_path: Path) -> SourceModel:
    return SourceModel("m", "echo", EchoPlugin, EchoPlugin.Options(), PluginContext("m", tmp_path), max_batch=8)


def test_a_format_runs_after_the_format_it_needs() -> None:
    onnx, engine = Onnx(), Engine()
    assert [step.exporter for step in export_steps(found(onnx, engine), "engine")] == [onnx, engine]
    assert [step.exporter for step in export_steps(found(onnx, engine), "onnx")] == [onnx]
    assert [step.exporter for step in export_steps(found(onnx, engine), "engine", from_file=True)] == [engine]


def test_auto_runs_the_fleet_exporters_then_the_converters_where_they_can_run() -> None:
    steps = export_steps(found(Onnx(), Engine()), "auto")
    assert [(s.exporter.format, s.optional) for s in steps] == [("onnx", False), ("engine", True)]


@pytest.mark.parametrize(("fmt", "from_file", "message"), [
    ("gif", False, (r"no exporter for format 'gif' is installed \(installed: engine, onnx\); exporter 'bad' is broken: "
                    r"ImportError: x; the bundled exporters come with the onnx and tensorrt plugins")),
    ("onnx", True, "the onnx exporter exports a fleet model"),
    ("auto", True, "--from needs a named --format"),
])
def test_what_cannot_be_planned_is_named(fmt: str, from_file: bool, message: str) -> None:
    with pytest.raises(ExportError, match=message):
        export_steps(found(Onnx(), Engine(), broken={"bad": "ImportError: x"}), fmt, from_file=from_file)


def test_a_converter_whose_source_format_is_missing_says_so() -> None:
    with pytest.raises(ExportError, match="format 'engine' is built from 'onnx', and no exporter for format 'onnx'"):
        export_steps(found(Engine()), "engine")


def test_each_exporter_gets_plain_values_and_the_file_before_it(tmp_path: Path) -> None:
    onnx, engine = Onnx(), Engine()
    lines: list[str] = []
    model = source(tmp_path)
    paths = run_export(export_steps(found(onnx, engine), "engine"), model="m", source=model, fp16=True, device="cuda:1",
                       progress=lines.append)
    assert paths == [tmp_path / "m.onnx", tmp_path / "m.engine"]
    (first,), (second,) = onnx.jobs, engine.jobs
    assert (first.source, first.input, first.out) == (model, None, tmp_path / "m.onnx")
    assert (second.source, second.input, second.out) == (None, tmp_path / "m.onnx", tmp_path / "m.engine")
    assert second.fp16 and second.device == "cuda:1"
    assert lines == ["wrote m.onnx", "wrote m.engine"]


def test_out_names_the_first_file_and_a_converter_writes_beside_its_input(tmp_path: Path) -> None:
    steps = export_steps(found(Onnx(), Engine()), "engine")
    paths = run_export(steps, model="m", source=source(tmp_path), out=tmp_path / "y.onnx", progress=print)
    assert paths == [tmp_path / "y.onnx", tmp_path / "y.engine"]


def test_a_file_from_elsewhere_is_converted_without_a_fleet(tmp_path: Path) -> None:
    engine = Engine()
    given = tmp_path / "exported.onnx"
    paths = run_export(export_steps(found(Onnx(), engine), "engine", from_file=True), model="exported", input_file=given)
    assert paths == [tmp_path / "exported.engine"] and engine.jobs[0].input == given


def test_a_required_step_that_cannot_run_fails_before_anything_is_written(tmp_path: Path) -> None:
    onnx = Onnx()
    with pytest.raises(ExportError, match="cannot build the engine for 'm': no GPU here"):
        run_export(export_steps(found(onnx, BlockedEngine()), "engine"), model="m", source=source(tmp_path))
    assert onnx.jobs == [] and list(tmp_path.iterdir()) == []


def test_auto_skips_a_converter_that_cannot_run_and_says_why(tmp_path: Path) -> None:
    lines: list[str] = []
    steps = export_steps(found(Onnx(), BlockedEngine()), "auto")
    paths = run_export(steps, model="m", source=source(tmp_path), progress=lines.append)
    assert paths == [tmp_path / "m.onnx"]
    assert lines == ["wrote m.onnx", "skipped the engine: no GPU here"]


def test_source_model_names_the_fleet_models_when_one_is_missing(tmp_path: Path) -> None:
    from router.config import FleetConfig
    from router.serving.plan import resolve_fleet
    from router.serving.registry import PluginRegistry

    fleet = FleetConfig.model_validate({"model_store": str(tmp_path), "models": {"a": {"plugin": "toy"}}})
    plan = resolve_fleet(fleet, PluginRegistry.from_entry_points(only={"toy"}), "fleet.yaml")
    with pytest.raises(ExportError, match="fleet.yaml: no model 'b'; the fleet has: a"):
        source_model(plan, "b")
    model = source_model(plan, "a")
    assert (model.plugin, model.max_batch, model.context.store_dir) == ("toy", 8, tmp_path)


class Unnamed(FakeExporter):
    title, suffix = "thing", ".x"


@pytest.mark.parametrize(("name", "target", "message"), [
    ("onnx", len, "must name a router.sdk.Exporter subclass"),
    ("onnx", Exporter, "does not implement: export"),
    ("x", Unnamed, "must set format"),
    ("tensorrt", Onnx, "writes format 'onnx' but is declared as 'tensorrt'"),
])
def test_unfit_exporters_are_refused_when_discovered(name: str, target: object, message: str) -> None:
    with pytest.raises(PluginValidationError, match=message):
        check_exporter(name, target)
