"""The checks a request passes on its way in (and its answer on its way out). Each raises the
RouterError that answers the request; none has side effects."""

from __future__ import annotations

import math
from collections.abc import Mapping
from fnmatch import fnmatch
from typing import Any

from router.errors import DeadlineExceeded, InputError, ModelError, QueueFull, UnsupportedMediaType, clip
from router.sdk.plugin import Payload
from router.serving.deployment import Deployment

__all__ = ["check_answer", "check_deadline_gate", "check_media_type", "check_priority", "check_timeout"]

_JSON_SCALARS = (str, int, bool, type(None))


def check_deadline_gate(
    deployment: Deployment, budget_s: float, now: float, *, take_turn: bool = True,
    device_free_at: Mapping[str, float] | None = None, must_finish: bool = False,
) -> bool:
    """Refuse at once (503) a request that the work already queued and running would push past
    its deadline, rather than queueing it to answer 504 later. Returns whether the request is
    admitted to measure the model's real answer time (it is then never dropped at dispatch).
    With `must_finish` (a step of a request that has spent part of its time already) the
    refusal is the deadline's, 504, and even an idle model refuses what it cannot finish."""
    decision = deployment.deadline_gate(budget_s, now, take_turn=take_turn, device_free_at=device_free_at,
                                        strict=must_finish)
    if not decision.admit and must_finish:
        raise DeadlineExceeded(f"model {deployment.name!r} cannot answer before the deadline: {decision.reason}; "
                               "the input was not run")
    if not decision.admit:
        raise QueueFull(
            f"model {deployment.name!r} is overloaded: {decision.reason}; retry later",
            retry_after_s=decision.retry_after_s,
        )
    return decision.measure


def check_media_type(deployment: Deployment, payload: Payload) -> None:
    accepts = deployment.plugin.cls.accepts
    media = payload.media_type.split(";", 1)[0].strip().lower()
    images = any(a.startswith("image/") for a in accepts)
    if images and (payload.pixels is not None or media == "application/octet-stream"):
        return  # decoded pixels, or bytes of unknown type: the plugin sniffs the real format
    if not any(fnmatch(media, pattern) for pattern in accepts):
        raise UnsupportedMediaType(
            f"model {deployment.name!r} does not accept {clip(media, 80) or 'an empty media type'}; "
            f"accepted: {', '.join(accepts)}"
        )


def check_priority(deployment: Deployment, priority: int | None) -> int:
    levels = deployment.config.queue.priority_levels
    if priority is None:
        return deployment.config.queue.default_priority
    if not 1 <= priority <= levels:
        raise InputError(f"X-Priority must be an integer from 1 to {levels}, got {priority}")
    return priority


def check_timeout(deployment: Deployment, timeout_ms: float | None) -> float:
    """The request's time budget in seconds: the model's queue timeout, or shorter if asked."""
    limit = deployment.config.queue.timeout_ms
    if timeout_ms is None:
        return limit / 1000.0
    if not timeout_ms > 0:
        raise InputError(f"X-Timeout-Ms must be a positive number of milliseconds, got {timeout_ms}")
    return min(timeout_ms, limit) / 1000.0


def check_answer(deployment: Deployment, answer: Any) -> None:
    """An answer must be plain JSON: a NaN or an object JSON cannot carry is the plugin's error
    (500, naming plugin, hook and where in the answer), never a silent `null`."""
    problem = _json_problem(answer, "answer")
    if problem is not None:
        raise ModelError(
            f"model {deployment.name!r}: plugin {deployment.plugin.name!r} returned from postprocess {problem}"
        )


def _json_problem(value: Any, path: str, depth: int = 0) -> str | None:
    if depth > 64:
        return f"a value nested more than 64 levels deep at {path}"
    if isinstance(value, float):
        return None if math.isfinite(value) else f"{value} at {path}, which JSON cannot carry"
    if isinstance(value, str) and not value.isascii():
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return f"text at {path} that is not Unicode (a lone surrogate)"
        return None
    if isinstance(value, _JSON_SCALARS):
        return None
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                return f"a non-string key {key!r} at {path}"
            if (problem := _json_problem(item, f"{path}.{key}", depth + 1)) is not None:
                return problem
        return None
    if isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            if (problem := _json_problem(item, f"{path}[{index}]", depth + 1)) is not None:
                return problem
        return None
    return f"a {type(value).__name__} at {path}, which is not JSON (return str, int, float, bool, None, list or dict)"
