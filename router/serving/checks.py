"""The checks of a request's body on its way in and of its answer on its way out (the rules on its
headers are `router.serving.rules`). Each raises the RouterError that answers the request; none
has side effects."""

from __future__ import annotations

import math
from collections.abc import Sequence
from fnmatch import fnmatch
from typing import Any

from router.errors import ModelError, UnsupportedMediaType, clip
from router.sdk.plugin import Payload

__all__ = ["check_answer", "check_media_type"]

_JSON_SCALARS = (str, int, bool, type(None))


def check_media_type(model: str, accepts: Sequence[str], payload: Payload) -> None:
    """415 for a media type the model's plugin does not accept."""
    media = payload.media_type.split(";", 1)[0].strip().lower()
    images = any(a.startswith("image/") for a in accepts)
    if images and (payload.pixels is not None or media == "application/octet-stream"):
        return  # decoded pixels, or bytes of unknown type: the plugin sniffs the real format
    if not any(fnmatch(media, pattern) for pattern in accepts):
        raise UnsupportedMediaType(
            f"model {model!r} does not accept {clip(media, 80) or 'an empty media type'}; "
            f"accepted: {', '.join(accepts)}"
        )


def check_answer(model: str, plugin: str, answer: Any) -> None:
    """An answer must be plain JSON: a NaN or an object JSON cannot carry is the plugin's error
    (500, naming plugin, hook and where in the answer), never a silent `null`."""
    problem = _json_problem(answer, "answer")
    if problem is not None:
        raise ModelError(
            f"model {model!r}: plugin {plugin!r} returned from postprocess {problem}"
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
