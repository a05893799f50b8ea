"""A pipeline at one moment, as `GET /models`, `GET /pipelines`, V2 and the live page show it."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from router.serving.facade import Serving
from router.serving.plan import PipelinePlan

__all__ = ["PipelineInfo", "pipeline_info"]


@dataclass(frozen=True)
class PipelineInfo:
    name: str
    state: str  # ready: every model it uses serves; else unavailable
    error: str | None
    steps: tuple[dict[str, Any], ...]
    timeout_ms: int
    models: tuple[str, ...]
    entry: str  # the model its requests enter by
    accepts: tuple[str, ...]  # the entry model's media types
    requests: Mapping[str, int]

    @property
    def serving(self) -> bool:
        return self.state == "ready"

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "kind": "pipeline", "state": self.state, "error": self.error,
                "steps": list(self.steps), "timeout_ms": self.timeout_ms, "models": list(self.models),
                "entry": self.entry, "requests": dict(self.requests)}


def pipeline_info(plan: PipelinePlan, facade: Serving, requests: Mapping[str, int]) -> PipelineInfo:
    routes = facade.routes()  # a routed name's state is its stable version's
    models = {name: facade.model(routes[name].deployment(routes[name].stable) if name in routes else name)
              for name in plan.models}
    down = [f"model {name} is {info.state}" for name, info in models.items() if not info.serving]
    return PipelineInfo(
        name=plan.name, state="unavailable" if down else "ready", error="; ".join(down) or None,
        steps=tuple(step.model_dump(exclude_defaults=True) for step in plan.config.steps),
        timeout_ms=plan.config.timeout_ms, models=plan.models, entry=plan.entry,
        accepts=models[plan.entry].accepts if plan.entry in models else (), requests=dict(requests),
    )
