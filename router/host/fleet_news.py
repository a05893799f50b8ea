"""What the engine tells its fronts about the fleet: `Models` (to build their plugin objects and
find each model's board slot), `Snapshot`s (for /models, /health/ready, /metrics, /ui), and the
board's figures. It also takes the fronts' answer lags back into each model's deadline gate.
"""

from __future__ import annotations

import logging
import pickle
import time
from typing import Any

import msgspec

from router.host.board import MAX_MODELS, BoardWriter
from router.host.messages import Lags, ModelEntry, Models, Snapshot
from router.serving.deployment import Deployment
from router.serving.intake import SHUTTING_DOWN
from router.serving.runtime import Runtime
from router.serving.verbs import pipeline_wire

__all__ = ["FleetNews"]

log = logging.getLogger("router.host.fleet_news")
SNAPSHOT_EVERY_S = 0.5


class FleetNews:
    def __init__(self, runtime: Runtime, board: BoardWriter) -> None:
        self.runtime = runtime
        self.board = board
        self._slots: dict[str, int] = {}
        self._front_states: dict[tuple[str, int], bytes | None] = {}  # (model, generation): pickled state
        self._sent_models: tuple[Any, ...] | None = None
        self._sent_state: tuple[Any, ...] | None = None
        self._snapshot_at = 0.0
        self._force = False

    # -- Models ---------------------------------------------------------------------------------

    def _slot(self, name: str) -> int:
        slot = self._slots.get(name)
        if slot is None:
            taken = set(self._slots.values())
            slot = next((s for s in range(1, MAX_MODELS + 1) if s not in taken), 0)
            if slot == 0:
                raise RuntimeError(f"the board holds at most {MAX_MODELS} models")
            self._slots[name] = slot
        return slot

    def _front_state(self, deployment: Deployment) -> bytes | None:
        """The pickled `front_state()` of a serving instance, once per generation (None until one serves)."""
        key = (deployment.name, deployment.generation)
        if key in self._front_states:
            return self._front_states[key]
        serving = next((i for i in deployment.instances if i.serving), None)
        if serving is None:
            return None
        try:
            state = pickle.dumps(serving.plugin.front_state(), protocol=5)
        except Exception as exc:  # noqa: BLE001  # the plugin's state or its pickling: served from the engine
            log.warning("model %s: its front state cannot reach the fronts (%s: %s); its hooks run in the engine",
                        deployment.name, type(exc).__name__, exc, extra={"model": deployment.name})
            state = b""  # empty: the fronts send the raw body
        self._front_states[key] = state
        return state

    def models_message(self) -> Models:
        fleet = self.runtime.fleet
        entries = []
        for deployment in self.runtime.deployments.values():
            state = self._front_state(deployment)
            cls = deployment.plugin.cls
            entries.append(ModelEntry(
                deployment.name, self._slot(deployment.name), deployment.plugin.name,
                deployment.options.model_dump_json().encode(), deployment.generation, str(fleet.model_store),
                fleet.allow_absolute_paths, bool(getattr(cls, "preprocess_needs_model", False)) or state == b"",
                deployment.config.queue.timeout_ms, deployment.config.execution.timeout_ms,
                deployment.queue.max_size, deployment.config.queue.priority_levels, tuple(cls.accepts), state or None))
        pipelines = msgspec.msgpack.encode([pipeline_wire(plan) for plan in self.runtime.pipelines()])
        return Models(tuple(entries), pipelines, msgspec.msgpack.encode(list(self.runtime.routes().values())),
                      self.runtime.generation)

    # -- Snapshot -------------------------------------------------------------------------------

    def snapshot(self) -> Snapshot:
        runtime = self.runtime
        self._snapshot_at = time.monotonic()
        rollouts = {name: state for name in runtime.routes() if (state := runtime.rollout(name)) is not None}
        return Snapshot(runtime.ready, runtime.draining, msgspec.msgpack.encode(runtime.models()),
                        msgspec.msgpack.encode(runtime.devices()), msgspec.msgpack.encode(rollouts))

    def changed(self) -> None:
        """Something the fronts show changed (an admin call ended): send a snapshot at once."""
        self._force = True

    def due(self) -> tuple[Models | None, Snapshot | None]:
        """What to send now: `Models` if the fleet or a front state changed, a `Snapshot` if a
        model's state, queue depth or running batches changed or half a second passed."""
        deployments = list(self.runtime.deployments.values())
        models_key = (self.runtime.generation, tuple(self._front_state(d) is not None for d in deployments))
        models = None
        if models_key != self._sent_models:
            self._sent_models = models_key
            models = self.models_message()
            for name in set(self._slots) - {d.name for d in deployments}:
                self.board.clear(self._slots.pop(name))
        state_key = (self.runtime.ready, self.runtime.draining,
                     tuple((d.name, d.state, d.residency.held, d.residency.held_down, d.queue.depth,
                            tuple((i.busy, i.batches) for i in d.instances)) for d in deployments))
        snapshot = None
        if self._force or state_key != self._sent_state or time.monotonic() - self._snapshot_at >= SNAPSHOT_EVERY_S:
            self._force = False
            self._sent_state = state_key
            snapshot = self.snapshot()
        return models, snapshot

    # -- the board ------------------------------------------------------------------------------

    def publish_board(self, epoch: int) -> None:
        runtime = self.runtime
        now = time.monotonic()
        refusal = SHUTTING_DOWN if runtime.intake.closing else None
        free = runtime.intake.free_at(now)
        for deployment in runtime.deployments.values():
            self.board.publish(self._slot(deployment.name), deployment.generation,
                               deployment.figures(now, refusal=refusal, device_free_at=free))
        self.board.header(epoch, runtime.ready, runtime.draining, now)

    def observe_lags(self, lags: Lags) -> None:
        """The fronts' time from a batch's end to its answer, into each model's deadline gate."""
        now = time.monotonic()
        for name, (count, total) in lags.models.items():
            deployment = self.runtime.deployments.get(name)
            if deployment is not None and count:
                deployment.lag.observe(total / count, now)

    @staticmethod
    def encode(value: Any) -> bytes:
        return msgspec.msgpack.encode(value)
