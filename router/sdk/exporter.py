"""The exporter contract: what a distribution implements to write a model format for `model-router export`.

An exporter is an `Exporter` subclass declared under the entry-point group `model_router.exporters`:

    [project.entry-points."model_router.exporters"]
    onnx = "model_router_onnx.export:OnnxExporter"

The command line resolves the fleet and hands the exporter plain values (an `ExportJob`); an
exporter never reads fleet files. An exporter either exports a fleet model, loaded by its own
plugin (`needs` is None), or converts a file another exporter wrote (`needs` names that format),
so `--format tensorrt` runs the `onnx` exporter first and hands its file on.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from pydantic import BaseModel

from router.sdk.plugin import ModelPlugin, PluginContext

__all__ = ["EXPORTERS_GROUP", "ExportError", "ExportJob", "Exporter", "Progress", "SourceModel"]

EXPORTERS_GROUP = "model_router.exporters"

Progress = Callable[[str], None]


class ExportError(RuntimeError):
    """The export cannot be made, or does not match its source; the message says why."""


@dataclass(frozen=True)
class SourceModel:
    """A fleet model as plain values: its plugin class, validated options and context, and the
    largest batch the fleet will run (the batch profile an export is built for)."""

    name: str
    plugin: str  # the plugin's entry-point name
    plugin_class: type[ModelPlugin[Any]]
    options: BaseModel
    context: PluginContext
    max_batch: int

    def create(self, **overrides: Any) -> ModelPlugin[Any]:
        """A new, unloaded plugin object for this model, with some options changed (e.g. half=False)."""
        known = {key: value for key, value in overrides.items() if key in type(self.options).model_fields}
        options = self.options.model_copy(update=known) if known else self.options
        return self.plugin_class(options, self.context)


@dataclass(frozen=True)
class ExportJob:
    """One file to write: from `source` (a fleet model) or from `input` (a file of the format the
    exporter `needs`), to `out`."""

    model: str  # names the model in progress lines and in the file's metadata
    out: Path
    source: SourceModel | None = None
    input: Path | None = None
    fp16: bool = False
    device: str = "cuda:0"  # where an engine is built and checked
    progress: Progress = print


class Exporter(ABC):
    """Writes one model format. Checks what it wrote before giving it its final name."""

    #: The `--format` name, e.g. "onnx".
    format: ClassVar[str]
    #: What it writes, for messages: "ONNX model", "TensorRT engine".
    title: ClassVar[str]
    #: The suffix of the file it writes, e.g. ".onnx": the default output is the model's name with it.
    suffix: ClassVar[str]
    #: The format it converts from; None: it exports a fleet model loaded by its own plugin.
    needs: ClassVar[str | None] = None

    def problems(self, device: str) -> list[str]:
        """Why this exporter cannot run here (a missing library or device); empty when it can."""
        return []

    @abstractmethod
    def export(self, job: ExportJob) -> Path:
        """Write and check `job.out`; raise ExportError naming the reason when that cannot be done."""
