"""Pipelines: several models chained in one request, run through the serving façade (a front)."""

from router.pipelines.info import PipelineInfo
from router.pipelines.runner import MAX_STEP_ITEMS, PipelineRunner
from router.pipelines.steps import PipelineAnswer, PipelineTelemetry

__all__ = ["MAX_STEP_ITEMS", "PipelineAnswer", "PipelineInfo", "PipelineRunner", "PipelineTelemetry"]
