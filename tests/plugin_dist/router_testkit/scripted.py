"""A plugin whose behaviour a test scripts: batch cost a + b*n, failures, hangs, out-of-memory.

Input: JSON `{"id": "...", ...}`. Output: `{"id": ..., "batch": k}`. With `record` set, each
executed batch appends a JSON line `{"model", "ids", "start", "end"}` (`clock`), so a test in
another process can see exactly what ran and when.

Its costs are waited out with `sleep` and timed with `clock`: a test on a virtual clock puts its
loop's there (tests/virtual_clock.py), and batches then cost virtual time, not real time.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from router.sdk import DeviceOutOfMemory, InputError, MemoryEstimate, ModelPlugin, Payload

#: What loads and batches wait their cost with, and what their records' times read.
sleep: Callable[[float], None] = time.sleep
clock: Callable[[], float] = time.monotonic


class ScriptedOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    fixed_ms: float = Field(0.0, ge=0, description="cost of a batch: fixed_ms + per_item_ms * n")
    per_item_ms: float = Field(0.0, ge=0)
    fail: Literal["never", "always", "marked"] = "never"  # marked: fail batches holding an id starting 'fail'
    hang_on: str | None = Field(None, description="an id whose batch sleeps hang_ms")
    hang_ms: float = 0.0
    oom_above: int | None = Field(None, description="raise out-of-memory for batches larger than this")
    oom_marker: str | None = Field(None, description="raise out-of-memory for batches holding an id with this prefix")
    weights_bytes: int = 1_000_000
    per_item_bytes: int = 1_000
    fixed_bytes: int = 0
    load_error: str | None = None
    load_ms: float = Field(0.0, ge=0, description="time load() takes")
    post_ms: float = Field(0.0, ge=0, description="time postprocess() takes; it fails once the model is unloaded")
    slow_first: int = Field(0, ge=0, description="this many first batches after warm-up cost slow_factor times more")
    slow_factor: float = Field(1.0, ge=1.0, description="a cold start under load: lazy set-up, cold caches, contention")
    record: str | None = None
    stdlib_json: bool = Field(False, description="parse with json.loads, as a plugin that skips the SDK's loader")
    label: str | None = Field(None, description="added to each answer: versions with other labels disagree")


class ScriptedPlugin(ModelPlugin[ScriptedOptions]):
    Options = ScriptedOptions
    accepts = ("application/json", "application/octet-stream")

    def load(self, device: str) -> None:
        sleep(self.options.load_ms / 1000.0)
        if self.options.load_error:
            raise RuntimeError(self.options.load_error)
        self.loaded = True
        self.batches = 0
        self.served = 0  # batches other than warm-up
        self._lock = threading.Lock()

    def preprocess(self, payload: Payload) -> str:
        if payload.media_type.startswith("application/json"):
            expected = 'JSON like {"id": "..."}'
            try:
                if self.options.stdlib_json:
                    parsed = json.loads(payload.body)
                else:  # imported here: the tracing bench runs this plugin on a router older than the loader
                    from router.sdk import loads_bounded

                    parsed = loads_bounded(payload.body, "the input", expected=expected)
                return str(parsed["id"])
            except (KeyError, TypeError) as exc:
                raise InputError(f"expected {expected}: {exc}") from None
        return payload.body.decode("utf-8", "replace")[:64]

    def predict_batch(self, items: Sequence[str]) -> list[dict[str, Any]]:
        options = self.options
        if options.oom_above is not None and len(items) > options.oom_above:
            raise DeviceOutOfMemory(f"scripted out-of-memory for a batch of {len(items)}")
        if options.oom_marker is not None and any(i.startswith(options.oom_marker) for i in items):
            raise DeviceOutOfMemory(f"scripted out-of-memory for a batch holding {options.oom_marker}*")
        start = clock()
        cost_ms = options.fixed_ms + options.per_item_ms * len(items)
        if "warmup" not in items:
            with self._lock:
                self.served += 1
                cost_ms *= options.slow_factor if self.served <= options.slow_first else 1.0
        if cost_ms:  # a no-op model does not yield its thread for nothing
            sleep(cost_ms / 1000.0)
        if options.hang_on is not None and options.hang_on in items:
            sleep(options.hang_ms / 1000.0)
        end = clock()
        with self._lock:
            self.batches += 1
            batch = self.batches
        self._record(items, start, end)
        if options.fail == "always" or (options.fail == "marked" and any(i.startswith("fail") for i in items)):
            raise RuntimeError(f"scripted failure in batch {batch}")
        if options.label is not None:
            return [{"id": item, "batch": batch, "label": options.label} for item in items]
        return [{"id": item, "batch": batch} for item in items]

    def postprocess(self, output: Any, item: Any) -> Any:
        if self.options.post_ms:  # no sleep(0): a no-op model's postprocess is free, as a real one's would be
            time.sleep(self.options.post_ms / 1000.0)
        if not getattr(self, "loaded", False):  # as a real model's would: its network is gone
            raise RuntimeError("model is not loaded")
        return output

    def unload(self) -> None:
        self.loaded = False

    def agreement(self, answer: Any, other: Any) -> float | None:
        """Two answers agree when they name the same input and label (the batch number is the run's own)."""
        return 1.0 if (answer["id"], answer.get("label")) == (other["id"], other.get("label")) else 0.0

    def adopt_front_state(self, state: Any) -> None:
        """A split host's front process: this object was never loaded, but the engine's is."""
        self.loaded = True

    def _record(self, items: Sequence[str], start: float, end: float) -> None:
        if self.options.record is None:
            return
        line = json.dumps({"model": self.context.model_name, "ids": list(items), "start": start, "end": end})
        with self._lock, open(self.options.record, "a", encoding="utf-8") as handle:
            handle.write(line + "\n")

    def memory_estimate(self) -> MemoryEstimate:
        o = self.options
        return MemoryEstimate(o.weights_bytes, o.per_item_bytes, o.fixed_bytes)

    def example_payload(self) -> Payload:
        return Payload(b'{"id": "warmup"}', "application/json")
