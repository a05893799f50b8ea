"""The fleet calls, each one typed message: what `Serving` asks of its core's fleet.

The admin routes (load, unload, PUT, DELETE, reload, versions, splits) and a drain reach the
one runtime there is: in this process (`Runtime.call` applies the verb), or in the engine of a
split host (a front sends it as `Call` and one `CallReply` answers it). Each verb is declared
once, here: its arguments (the struct's fields, tagged by its class name), what it returns
(`Verb[R]`: the reply's result decodes as `R`) and how the runtime runs it (`apply`). Results
travel as msgpack of the same frozen snapshots the routes show.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Generic, TypeVar, get_args, get_origin

import msgspec

from router.pipeline_config import PipelineConfig
from router.serving.editor import ReloadReport
from router.serving.plan import PipelinePlan
from router.serving.residency_executor import UnloadReport
from router.serving.snapshots import ModelInfo
from router.serving.traffic import TrafficChange
from router.serving.versions import VersionRoute

if TYPE_CHECKING:
    from router.serving.runtime import Runtime

__all__ = [
    "AdminVerb",
    "BeginDrain",
    "DeleteModel",
    "DeletePipeline",
    "DeleteVersion",
    "LoadModel",
    "PutModel",
    "PutPipeline",
    "PutVersion",
    "ReleaseModel",
    "Reload",
    "SetTraffic",
    "UnloadModel",
    "Verb",
    "pipeline_from_wire",
    "pipeline_wire",
]

R = TypeVar("R")
Reports = tuple[ModelInfo, list[UnloadReport]]
#: A pipeline's outcome (added | changed | unchanged) and its plan as `pipeline_wire`.
PipelineOutcome = tuple[str, dict[str, Any]]


def pipeline_wire(plan: PipelinePlan) -> dict[str, Any]:
    """A pipeline's plan as plain data, for a message."""
    return {"name": plan.name, "config": plan.config.model_dump(mode="json"), "models": list(plan.models),
            "entry": plan.entry}


def pipeline_from_wire(data: dict[str, Any]) -> PipelinePlan:
    return PipelinePlan(data["name"], PipelineConfig.model_validate(data["config"]), tuple(data["models"]), data["entry"])


class Verb(msgspec.Struct, Generic[R], frozen=True, array_like=True, tag=True, gc=False):
    """An admin verb that returns an `R`: its fields are its arguments, its class name its tag."""

    #: `R` itself, taken from the subclass's base `Verb[R]`: the reply's result decodes as this.
    returns: ClassVar[Any]

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        for base in getattr(cls, "__orig_bases__", ()):
            if get_origin(base) is Verb:
                cls.returns = get_args(base)[0]

    async def apply(self, runtime: Runtime) -> R:
        """Run the verb on the runtime that holds the fleet."""
        raise NotImplementedError

    def result(self, data: bytes) -> R:
        """The reply's result, as this verb returns it."""
        value: R = msgspec.msgpack.decode(data, type=type(self).returns)
        return value


class LoadModel(Verb[ModelInfo]):
    name: str

    async def apply(self, runtime: Runtime) -> ModelInfo:
        return await runtime.load_model(self.name)


class UnloadModel(Verb[Reports]):
    name: str

    async def apply(self, runtime: Runtime) -> Reports:
        return await runtime.unload_model(self.name)


class ReleaseModel(Verb[Reports]):
    name: str
    unload: bool

    async def apply(self, runtime: Runtime) -> Reports:
        return await runtime.release_model(self.name, unload=self.unload)


class PutModel(Verb[tuple[str, ModelInfo]]):
    name: str
    section: dict[str, Any]
    source: str

    async def apply(self, runtime: Runtime) -> tuple[str, ModelInfo]:
        return await runtime.put_model(self.name, self.section, self.source)


class DeleteModel(Verb[None]):
    name: str

    async def apply(self, runtime: Runtime) -> None:
        await runtime.delete_model(self.name)


class Reload(Verb[ReloadReport]):
    path: str | None  # None: the fleet file served

    async def apply(self, runtime: Runtime) -> ReloadReport:
        return await runtime.reload(Path(self.path) if self.path else None)


class PutPipeline(Verb[PipelineOutcome]):
    name: str
    section: dict[str, Any]
    source: str

    async def apply(self, runtime: Runtime) -> PipelineOutcome:
        outcome, plan = await runtime.put_pipeline(self.name, self.section, self.source)
        return outcome, pipeline_wire(plan)


class DeletePipeline(Verb[None]):
    name: str

    async def apply(self, runtime: Runtime) -> None:
        await runtime.delete_pipeline(self.name)


class BeginDrain(Verb[None]):
    async def apply(self, runtime: Runtime) -> None:
        runtime.begin_drain()


class PutVersion(Verb[tuple[str, ModelInfo]]):
    name: str
    version: str
    section: dict[str, Any]
    source: str

    async def apply(self, runtime: Runtime) -> tuple[str, ModelInfo]:
        return await runtime.put_version(self.name, self.version, self.section, self.source)


class DeleteVersion(Verb[None]):
    name: str
    version: str

    async def apply(self, runtime: Runtime) -> None:
        await runtime.delete_version(self.name, self.version)


class SetTraffic(Verb[VersionRoute]):
    name: str
    change: TrafficChange

    async def apply(self, runtime: Runtime) -> VersionRoute:
        return await runtime.set_traffic(self.name, self.change)


#: Every admin verb: what `Call.verb` decodes as. A tag not here is refused at decode.
AdminVerb = (LoadModel | UnloadModel | ReleaseModel | PutModel | DeleteModel | Reload | PutPipeline | DeletePipeline
             | BeginDrain | PutVersion | DeleteVersion | SetTraffic)
