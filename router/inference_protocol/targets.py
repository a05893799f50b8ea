"""What a name in a V2 call names: a model, or a pipeline, which V2 clients see as a model (as
Triton's ensembles): its metadata, its readiness, where its items go, its line in the repository
index. V2 over HTTP and over gRPC (and gRPC's health service) answer from these, so a pipeline is
the same model over both."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, Protocol

from router.errors import EngineUnavailable, ModelNotFound
from router.inference_protocol import repository
from router.inference_protocol.submission import Entry
from router.routing import VersionRouter
from router.sdk.plugin import Payload
from router.serving.facade import ModelInputs, Serving
from router.serving.plan import PipelinePlan
from router.serving.rules import Screened
from router.serving.snapshots import ModelInfo
from router.serving.versions import split_name
from router.tracing.api import Phases

__all__ = ["PipelineState", "Pipelines", "Target", "find_target", "is_ready", "repository_index", "served_version"]


class PipelineState(Protocol):
    """A pipeline's snapshot, as the runner gives it (`router.pipelines.PipelineInfo`)."""

    @property
    def name(self) -> str: ...
    @property
    def serving(self) -> bool: ...
    @property
    def error(self) -> str | None: ...


class Pipelines(Protocol):
    """What V2 needs of the pipeline runner (`router.pipelines.PipelineRunner`, the front beside this one)."""

    @property
    def versions(self) -> VersionRouter: ...  # the front's version router, which every model name goes through
    def serves(self, name: str) -> bool: ...
    def plan(self, name: str) -> PipelinePlan: ...
    def info(self, name: str) -> PipelineState: ...
    def infos(self) -> Sequence[PipelineState]: ...
    def known_inputs(self, name: str) -> ModelInputs: ...  # 404 listing models and pipelines when it is neither
    def screen(self, name: str, *, priority: int | None = None, timeout_ms: float | None = None,
               received_at: float | None = None, items: int = 1, body_bytes: int | None = None) -> Screened: ...
    async def run(self, name: str, payload: Payload, *, priority: int | None = None, timeout_ms: float | None = None,
                  request_id: str | None = None, received_at: float | None = None,
                  trace: Phases | None = None, screened: Screened | None = None) -> Any: ...  # has `output`


@dataclass(frozen=True)
class Target:
    """A model, or a pipeline with the model its requests enter by (whose inputs are the pipeline's)."""

    name: str
    inputs: ModelInputs  # of the model its items go to: what an inference needs, without a snapshot
    entry: Entry
    runtime: Serving
    runner: Pipelines | None = None  # set for a pipeline
    versions: tuple[str, ...] = (repository.MODEL_VERSION,)

    @property
    def pipeline(self) -> bool:
        return self.runner is not None

    @property
    def model(self) -> ModelInfo:
        """The snapshot of the model its items go to, read now (metadata, readiness)."""
        return self.runtime.model(self.inputs.name)

    @property
    def serving(self) -> bool:
        """A model that serves; a pipeline whose every model serves."""
        return self.runner.info(self.name).serving if self.runner is not None else self.model.serving

    def metadata(self) -> dict[str, Any]:
        return repository.model_metadata(self.model, pipeline=self.name if self.runner is not None else None,
                                         name=self.name, versions=self.versions)


def find_target(runtime: Serving, pipelines: Pipelines, name: str, version: str | None = None) -> Target:
    """What `name` names; 404 for neither a model nor a pipeline (listing both) or a version it lacks."""
    versions = pipelines.versions
    if runtime.pipeline(name) is not None:
        plan = pipelines.plan(name)
        target = Target(name, runtime.inputs(versions.target(plan.entry)), Entry(name, pipelines.screen, pipelines.run),
                        runtime, pipelines)
    elif versions.serves(name):  # a model with versions: the pinned version's, else routed per request
        pinned = version or None
        inputs = runtime.inputs(versions.target(name, pinned))
        entry = Entry(name, partial(versions.screen, version=pinned, route_key=None),
                      partial(versions.submit, version=pinned))
        return Target(name, inputs, entry, runtime, versions=versions.route(name).versions)
    else:
        target = Target(name, pipelines.known_inputs(name), Entry(name, versions.screen, versions.submit), runtime)
    repository.check_version(name, version)
    return target


def served_version(answers: Sequence[Any]) -> str:
    """The version that served a request's answers (`model_version`): its deployment's."""
    model = getattr(answers[0], "model", "") if answers else ""
    return split_name(model)[1] or repository.MODEL_VERSION


def is_ready(runtime: Serving, pipelines: Pipelines, name: str, version: str | None = None) -> bool:
    """Whether `name` serves; an unknown name or version is not ready (as tritonclient.http reads a 404),
    nor is any while a split host's engine is away."""
    try:
        return find_target(runtime, pipelines, name, version).serving
    except (ModelNotFound, EngineUnavailable):
        return False


def repository_index(runtime: Serving, pipelines: Pipelines, *, ready_only: bool) -> list[repository.IndexEntry]:
    """Every model and then every pipeline (or the ready ones), with Triton's word for its state."""
    return repository.index_entries(runtime.models(), ready_only=ready_only,
                                    pipelines=[(p.name, p.serving, p.error) for p in pipelines.infos()])
