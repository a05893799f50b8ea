"""`model-router export`: exporters found through the entry-point group `model_router.exporters`,
chained by the format each one needs, and handed plain values from the resolved fleet.

`--format onnx` runs the `onnx` exporter on a fleet model; `--format tensorrt` runs `onnx` first
and builds the engine from its file (or from `--from FILE`, an ONNX file exported elsewhere);
`--format auto` runs every exporter of a fleet model, then every one that converts its file where
it can run here, saying why it skipped the others.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from router.errors import PluginValidationError
from router.sdk.exporter import EXPORTERS_GROUP, Exporter, ExportError, ExportJob, Progress, SourceModel
from router.sdk.plugin import PluginContext
from router.serving.plan import FleetPlan
from router.serving.registry import Discovered, discover

__all__ = ["ExportStep", "check_exporter", "export_steps", "installed_exporters", "run_export", "source_model"]

AUTO = "auto"
_INSTALL_HINT = "the bundled exporters come with the onnx and tensorrt plugins: pip install -e plugins/onnx"


@dataclass(frozen=True)
class ExportStep:
    exporter: Exporter
    optional: bool = False  # `auto`: skipped, with the reason, where it cannot run here


def installed_exporters() -> Discovered[Exporter]:
    """Every exporter declared under `model_router.exporters`, by format; broken ones with their error."""
    return discover(EXPORTERS_GROUP, check_exporter)


def export_steps(found: Discovered[Exporter], fmt: str, *, from_file: bool = False) -> list[ExportStep]:
    """The exporters that make `fmt`, in the order they run. Raises ExportError naming what is missing."""
    exporters = {entry.target.format: entry.target for entry in found.entries.values()}
    if fmt == AUTO:
        if from_file:
            raise ExportError("--from needs a named --format (e.g. tensorrt): auto exports a fleet model")
        roots = [exporters[name] for name in sorted(exporters) if exporters[name].needs is None]
        if not roots:
            raise ExportError(f"no exporter of fleet models is installed{_broken(found)}; {_INSTALL_HINT}")
        converters = [e for root in roots for name, e in sorted(exporters.items()) if e.needs == root.format]
        return [ExportStep(root) for root in roots] + [ExportStep(e, optional=True) for e in converters]
    chain = [_named(found, exporters, fmt)]
    if from_file and chain[0].needs is None:
        raise ExportError(f"the {fmt} exporter exports a fleet model (--model), not a file given with --from")
    while not from_file and chain[0].needs is not None:
        chain.insert(0, _named(found, exporters, chain[0].needs, wanted_by=chain[0].format))
    return [ExportStep(exporter) for exporter in chain]


def source_model(plan: FleetPlan, model: str) -> SourceModel:
    """A fleet model as the plain values an exporter takes."""
    if model not in plan.models:
        raise ExportError(f"{plan.source}: no model {model!r}; the fleet has: {', '.join(sorted(plan.models))}")
    resolved, config = plan.models[model], plan.fleet.models[model]
    context = PluginContext(model, plan.fleet.model_store, plan.fleet.allow_absolute_paths)
    return SourceModel(model, resolved.plugin.name, resolved.plugin.cls, resolved.options, context,
                       config.batch.max_size)


def run_export(
    steps: list[ExportStep],
    *,
    model: str,
    source: SourceModel | None = None,
    input_file: Path | None = None,
    out: Path | None = None,
    fp16: bool = False,
    device: str = "cuda:0",
    progress: Progress = print,
) -> list[Path]:
    """Run the steps: each converter takes the file of the format it needs. A required step that
    cannot run here fails before anything is written; the paths written are returned in order."""
    for step in steps:
        problems = step.exporter.problems(device)
        if problems and not step.optional:
            raise ExportError(f"cannot build the {step.exporter.title} for {model!r}: {'; '.join(problems)}")
    written: dict[str, Path] = {}
    for step in steps:
        exporter = step.exporter
        problems = exporter.problems(device) if step.optional else []
        if problems:
            progress(f"skipped the {exporter.title}: {'; '.join(problems)}")
            continue
        given = written.get(exporter.needs) if exporter.needs is not None else None
        given = given if given is not None else (input_file if exporter.needs is not None else None)
        target = _target(exporter, model, source, given, out if not written else None)
        job = ExportJob(model, target, source=source if exporter.needs is None else None, input=given,
                        fp16=fp16, device=device, progress=progress)
        written[exporter.format] = exporter.export(job)
    return list(written.values())


def _target(exporter: Exporter, model: str, source: SourceModel | None, given: Path | None, out: Path | None) -> Path:
    """`--out` for the first file; a converter's file beside its input; else MODEL_STORE/MODEL.suffix."""
    if out is not None:
        return out
    if given is not None:
        return given.with_suffix(exporter.suffix)
    if source is None:
        raise ExportError(f"the {exporter.format} exporter needs a fleet model (--config and --model)")
    return source.context.store_dir / f"{model}{exporter.suffix}"


def _named(found: Discovered[Exporter], exporters: Mapping[str, Exporter], fmt: str, wanted_by: str = "") -> Exporter:
    if fmt in exporters:
        return exporters[fmt]
    need = f"format {wanted_by!r} is built from {fmt!r}, and " if wanted_by else ""
    listing = ", ".join(sorted(exporters)) or "none"
    raise ExportError(f"{need}no exporter for format {fmt!r} is installed (installed: {listing}){_broken(found)}; "
                      f"{_INSTALL_HINT}")


def _broken(found: Discovered[Exporter]) -> str:
    return "".join(f"; exporter {name!r} is broken: {reason}" for name, reason in sorted(found.broken.items()))


def check_exporter(name: str, target: object) -> Exporter:
    if not (inspect.isclass(target) and issubclass(target, Exporter)):
        raise PluginValidationError(name, f"exporter entry point must name a router.sdk.Exporter subclass, got {target!r}")
    if inspect.isabstract(target):
        raise PluginValidationError(name, f"{target.__name__} does not implement: export")
    missing = [attr for attr in ("format", "title", "suffix") if not isinstance(getattr(target, attr, None), str)]
    if missing:
        raise PluginValidationError(name, f"{target.__name__} must set {', '.join(missing)} (strings)")
    if target.format != name:
        raise PluginValidationError(name, f"{target.__name__} writes format {target.format!r} but is declared as {name!r}")
    return target()
