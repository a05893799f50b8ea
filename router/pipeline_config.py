"""The `pipelines:` section of the fleet file, parsed: each pipeline's steps and deadline.

Only the shape is checked here (what each step is, and that models and transforms alternate);
the names a step uses, the transforms' options and whether each step can take what the one
before gives are checked against the fleet and the installed plugins by
`router.serving.plan`, before any port opens.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

__all__ = ["PipelineConfig", "StepConfig"]

#: What goes between two models when a pipeline's author has to choose, for error messages.
TRANSFORM_HINT = "`- transform: crop` (one item per detected box) or `- transform: whole` (the image passed on)"


class StepConfig(BaseModel):
    """One step: a model of the fleet, another pipeline, or a transform between two of those."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str | None = Field(None, description="a model of the fleet")
    pipeline: str | None = Field(None, description="another pipeline, run as one step")
    transform: str | None = Field(None, description="built in: crop, whole; others from plugins")
    options: dict[str, Any] = Field(default_factory=dict, description="the transform's options")

    @model_validator(mode="after")
    def _one_kind(self) -> StepConfig:
        given = [key for key in ("model", "pipeline", "transform") if getattr(self, key) is not None]
        if len(given) != 1:
            raise ValueError(f"a step names exactly one of model, pipeline or transform, got {', '.join(given) or 'none'}")
        if self.options and self.transform is None:
            raise ValueError(f"options belong to a transform step; this step is a {given[0]}")
        return self

    @property
    def kind(self) -> Literal["model", "pipeline", "transform"]:
        return "model" if self.model is not None else "pipeline" if self.pipeline is not None else "transform"

    @property
    def name(self) -> str:
        """The model, pipeline or transform the step names."""
        return str(self.model or self.pipeline or self.transform)

    def describe(self) -> str:
        return f"{self.kind} {self.name}"


class PipelineConfig(BaseModel):
    """One pipeline: models (or pipelines) in order, a transform between each two, one deadline."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    steps: list[StepConfig] = Field(min_length=1, max_length=64)
    timeout_ms: int = Field(10_000, ge=1, description="the whole pipeline's deadline; X-Timeout-Ms may shorten it")

    @model_validator(mode="after")
    def _alternate(self) -> PipelineConfig:
        """Models at even places, transforms at odd ones, a model last: every transform has a
        step before it to read and a model after it to feed."""
        for index, step in enumerate(self.steps):
            wants_transform = index % 2 == 1
            if wants_transform and step.kind != "transform":
                raise ValueError(f"steps[{index}] is a {step.kind} right after {self.steps[index - 1].describe()}; "
                                 f"put a transform between them: {TRANSFORM_HINT}")
            if not wants_transform and step.kind == "transform":
                where = "the first step" if index == 0 else f"right after transform {self.steps[index - 1].name}"
                raise ValueError(f"steps[{index}] is transform {step.name}, {where}; a transform goes between "
                                 "two models (or pipelines)")
        if self.steps[-1].kind == "transform":
            raise ValueError(f"the last step is transform {self.steps[-1].name}; end with the model it feeds")
        return self

    @property
    def models(self) -> list[str]:
        return [step.name for step in self.steps if step.kind == "model"]

    @property
    def pipelines(self) -> list[str]:
        return [step.name for step in self.steps if step.kind == "pipeline"]
