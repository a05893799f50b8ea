"""The residency executor: loads and unloads instances at run time, for the device schedulers'
residency plans (on-demand loads, evictions, idle unloads) and for operators.

Each device scheduler decides *what* is resident (the residency planner,
`router.scheduling.residency`); the executor does it, in the background, and tells the scheduler
when it is done. Loads are single-flight: an instance that is loading is never asked to load
again. An unload stops new batches, waits for the running one, calls the plugin's `unload`, gives
the memory back to the device (garbage collection, CUDA's cache, glibc's free lists), waits a
bounded time to see it back in the probe, and only then releases the weights from the ledger;
the bytes actually returned are logged and shown in `GET /models`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

from router.errors import InstanceLost, ModelDoesNotFit, ModelUnavailable
from router.scheduling.queue import reject
from router.scheduling.scheduler import DeviceScheduler
from router.serving.deployment import Deployment
from router.serving.fleet_state import FleetState
from router.serving.instance import InstanceState, ModelInstance
from router.serving.loading import load_instance
from router.serving.memory import give_back_memory
from router.serving.telemetry import Telemetry

__all__ = ["ResidencyExecutor", "UnloadReport"]

log = logging.getLogger("router.serving.residency_executor")
#: How long an unload waits to see its memory back in the probe before releasing the ledger anyway.
#: Giving memory back (process exit, CUDA's cache, glibc's trim) is synchronous; what has not come
#: back by then stays with the framework or the allocator (still seen by the probe, so batch admission
#: and residency count it).
MEMORY_BACK_WAIT_S = 0.25
#: The share of an instance's booked weights the probe must show returned to count as "back".
MEMORY_BACK_SHARE = 0.8


@dataclass(frozen=True)
class UnloadReport:
    model: str
    instance: str
    booked_bytes: int
    returned_bytes: int | None  # seen in the probe; None without a probe


class ResidencyExecutor:
    """Carries out residency plans for every device scheduler, and the admin verbs' loads and unloads."""

    def __init__(self, fleet: FleetState, telemetry: Telemetry, clock: Callable[[], float] = time.monotonic) -> None:
        self._fleet = fleet
        self.telemetry = telemetry
        self._clock = clock
        self._tasks: set[asyncio.Task[object]] = set()

    def notify(self, deployment: Deployment) -> None:
        """Wake the schedulers of the model's devices (its residency may need a decision)."""
        self._fleet.notify(deployment)

    def _spawn(self, work: Coroutine[Any, Any, object], name: str) -> None:
        task = asyncio.create_task(work, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def stop(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    # -- residency actions (called by the schedulers' step, on the event loop) ------------------

    def start_load(self, runner_key: str) -> None:
        deployment, instance = self._fleet.find_instance(runner_key)
        instance.begin_load()  # at once: the next plan sees it loading (single flight)
        deployment.residency.load_started(self._clock())
        self._spawn(self._load(deployment, instance), f"load-{runner_key}")

    def start_unload(self, runner_key: str, kind: str, detail: str) -> None:
        deployment, instance = self._fleet.find_instance(runner_key)
        instance.begin_drain()  # at once: no new batch for it
        self.count_eviction(deployment, instance, kind)
        self._spawn(self.unload_instance(deployment, instance, f"{kind}: {detail}"), f"unload-{runner_key}")

    def count_eviction(self, deployment: Deployment, instance: ModelInstance, kind: str) -> None:
        deployment.residency.evicted(kind)
        self.telemetry.observe_eviction(deployment.name, instance.device, kind)

    def instance_lost(self, runner_key: str, why: str) -> None:
        """An instance in service lost its process: fail it and give back its weights; with no other
        instance serving, answer its queue 503. An always-resident model is loaded again by residency
        (`Deployment.wanted`); an on-demand one with its next request."""
        try:
            deployment, instance = self._fleet.find_instance(runner_key)
        except KeyError:
            return
        if not instance.serving:  # loading, warming or unloading: that work fails or ends by itself
            return
        instance.lose(why)
        scheduler = self._fleet.scheduler_of(instance)
        if scheduler is not None:
            scheduler.release_weights(instance)
        res = deployment.residency
        res.instance_lost(why, reload=not deployment.on_demand)
        if not deployment.serving:
            retry = InstanceLost(f"model {deployment.name!r}: {why}; it is restarting",
                                 retry_after_s=res.load_left_s(self._clock()))
            for ticket in deployment.queue.withdraw_all():
                reject(ticket, retry)
        log.error("model %s instance %d: %s; %s", deployment.name, instance.index, why,
                  "loading it again" if res.lost else "it loads again on demand",
                  extra={"model": deployment.name, "instance": instance.key})
        self.notify(deployment)

    def cannot_load(self, runner_key: str, reason: str) -> None:
        deployment, _ = self._fleet.find_instance(runner_key)
        if deployment.residency.never_fits is None and deployment.residency.cannot_fit(reason):
            log.error("%s", reason, extra={"model": deployment.name})

    # -- loading ------------------------------------------------------------------------------

    async def _load(self, deployment: Deployment, instance: ModelInstance) -> None:
        scheduler = self._fleet.schedulers[instance.device]
        res = deployment.residency
        started = self._clock()
        try:
            ok = await asyncio.wait_for(
                load_instance(deployment, instance, scheduler, started=True, may_wait=True),
                deployment.config.load_timeout_ms / 1000,
            )
        except TimeoutError:
            ok = False
            instance.fail(f"load exceeded load_timeout_ms={deployment.config.load_timeout_ms}")
        seconds = self._clock() - started
        if ok or instance.state is not InstanceState.UNLOADED:
            self.telemetry.observe_load(deployment.name, instance.device, seconds, ok)
        if ok:
            res.load_succeeded(seconds)
        elif instance.state is InstanceState.UNLOADED:  # sized now; waits for room
            res.load_postponed()
        elif isinstance(instance.cause, ModelDoesNotFit):  # sized now: it never fits here
            res.cannot_fit(str(instance.cause), instance.error)
        else:
            res.load_failed(instance.error, self._clock())
        scheduler.notify()

    async def until_serving(self, deployment: Deployment, deadline: float) -> float:
        """Wait until the model serves (a load is under way or will be planned), or raise: 503
        with Retry-After when it cannot be in time, or why it cannot load. Returns the seconds
        waited."""
        res = deployment.residency
        started = self._clock()
        res.wait_for_load(deadline)
        self.notify(deployment)
        try:
            while not deployment.serving:
                refusal = res.refusal(deployment.name, deployment.loading, self._clock())
                if refusal is not None:
                    raise refusal.error()
                remaining = deadline - self._clock()
                if remaining <= 0:
                    raise ModelUnavailable(
                        f"model {deployment.name!r} is still loading after {(self._clock() - started) * 1000:.0f} ms, "
                        "past this request's deadline; retry shortly",
                        retry_after_s=res.load_left_s(self._clock()),
                    )
                changed = res.changed
                try:
                    await asyncio.wait_for(changed.wait(), remaining)
                except TimeoutError:
                    continue
        finally:
            res.stop_waiting(deadline)
        return self._clock() - started

    # -- unloading ----------------------------------------------------------------------------

    async def unload_instance(self, deployment: Deployment, instance: ModelInstance, why: str) -> UnloadReport:
        """Drain (if not yet), wait for the running batch, unload, give the memory back, release
        the ledger once the probe shows it back (or after a bounded wait)."""
        scheduler = self._fleet.scheduler_of(instance)
        if instance.state is InstanceState.READY or instance.state is InstanceState.FENCED:
            instance.begin_drain()
        await instance.until_batch_done()
        await instance.wait_idle()  # a stalled batch's thread too
        try:  # hooks running on its plugin, and answers it gave that are not yet postprocessed
            await asyncio.wait_for(instance.until_unused(), instance.execution_timeout_s)
        except TimeoutError:
            log.warning("model %s instance %d: unloading with pre- or postprocessing still running on it after %.1f s",
                        deployment.name, instance.index, instance.execution_timeout_s, extra={"model": deployment.name})
        booked = instance.estimate.weights_bytes if instance.estimate else 0
        before = scheduler.read_now() if scheduler is not None else None
        instance.begin_unload()
        try:
            await instance.call(instance.plugin.unload)
            await instance.call(give_back_memory, instance.device)
        except Exception as exc:
            log.exception("model %s instance %d: unload raised", deployment.name, instance.index,
                          extra={"model": deployment.name})
            if scheduler is not None:
                scheduler.release_weights(instance)
            instance.fail(f"unload raised {type(exc).__name__}: {exc}")
            deployment.residency.unload_failed()
            raise
        returned = await self._memory_back(scheduler, before, booked) if scheduler is not None else None
        if scheduler is not None:
            scheduler.release_weights(instance)
        instance.mark_unloaded()
        log.info("model %s instance %d unloaded from %s (%s): %s of %d booked bytes returned", deployment.name,
                 instance.index, instance.device, why, "unmeasured" if returned is None else returned, booked,
                 extra={"model": deployment.name, "booked_bytes": booked, "returned_bytes": returned})
        deployment.residency.unloaded(returned)
        if scheduler is not None:
            scheduler.notify()
        return UnloadReport(deployment.name, instance.key, booked, returned)

    async def _memory_back(self, scheduler: DeviceScheduler, before: int | None, booked: int) -> int | None:
        """Bytes the probe shows returned, waiting up to MEMORY_BACK_WAIT_S for most of `booked`."""
        if before is None:
            return None
        waited, step = 0.0, scheduler.config.poll_interval_ms / 1000
        while True:
            now = scheduler.read_now()
            if now is None:
                return None
            returned = before - now
            if returned >= MEMORY_BACK_SHARE * booked or waited >= MEMORY_BACK_WAIT_S:
                if returned < MEMORY_BACK_SHARE * booked:
                    log.info("device %s: %d of %d booked bytes came back within %.2f s of an unload; the rest "
                             "stays with the framework or the allocator", scheduler.device, max(0, returned), booked,
                             MEMORY_BACK_WAIT_S)
                return max(0, returned)
            await asyncio.sleep(step)
            waited += step
