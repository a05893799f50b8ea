"""Plugins for a split host's tests: where their hooks run, and one written before the split.

`UnsplitPlugin` reads in `postprocess` what `load` set, and knows nothing of front states: a
front process cannot postprocess with its unloaded object, and serves it from the engine once a
request shows that. `EngineHooksPlugin` says so itself (`preprocess_needs_model`). Both answer
`{"id": ..., "postprocessed_by": pid}`: the process that ran `postprocess`.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any, ClassVar

from router.sdk import InputError, MemoryEstimate, ModelPlugin, NoOptions, Payload, loads_bounded


class UnsplitPlugin(ModelPlugin[NoOptions]):
    accepts = ("application/json",)

    def load(self, device: str) -> None:
        self.suffix = "-served"  # what postprocess needs of the loaded model

    def preprocess(self, payload: Payload) -> str:
        try:
            return str(loads_bounded(payload.body, "the input", expected='JSON like {"id": "..."}')["id"])
        except (KeyError, TypeError) as exc:
            raise InputError(f'expected JSON like {{"id": "..."}}: {exc}') from None

    def predict_batch(self, items: Sequence[str]) -> list[str]:
        return list(items)

    def postprocess(self, output: Any, item: Any) -> dict[str, Any]:
        return {"id": output + self.suffix, "postprocessed_by": os.getpid()}

    def memory_estimate(self) -> MemoryEstimate:
        return MemoryEstimate(1000, 10)

    def example_payload(self) -> Payload:
        return Payload(b'{"id": "warmup"}', "application/json")


class EngineHooksPlugin(UnsplitPlugin):
    preprocess_needs_model: ClassVar[bool] = True
