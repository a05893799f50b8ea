"""Loading an instance: load, settle its memory figures, warm up, time its batches, book its
weights, put it in service. A failure marks that instance failed; other models go on.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

from router.errors import ModelDoesNotFit
from router.scheduling.scheduler import DeviceScheduler, NoRoomYet
from router.sdk.plugin import MemoryEstimate
from router.serving.deployment import Deployment
from router.serving.instance import ModelInstance
from router.serving.profiling import apply_declared, max_batch_within, profile_cuda, profile_sizes

__all__ = ["load_deployment", "load_instance", "warmup_sizes"]

log = logging.getLogger("router.serving.loading")
#: Timings of each batch size at warm-up; the fastest counts (one timing on a busy host can be
#: several times the device's speed, and the deadline gate would refuse by it).
TIMING_RUNS = 3


async def load_deployment(
    deployment: Deployment, schedulers: Mapping[str, DeviceScheduler], device_errors: Mapping[str, str]
) -> None:
    """Load every instance of a model; one that fails is marked failed, the others go on."""
    for instance in deployment.instances:
        scheduler = schedulers.get(instance.device)
        if scheduler is None:
            instance.fail(f"device {instance.device} unavailable: {device_errors.get(instance.device, 'unknown')}")
            continue
        await load_instance(deployment, instance, scheduler)
    log.info("model %s: %s", deployment.name, deployment.state.value, extra={"model": deployment.name})


async def load_instance(
    deployment: Deployment, instance: ModelInstance, scheduler: DeviceScheduler, *, started: bool = False,
    may_wait: bool = False,
) -> bool:
    """Load, size, warm up and time one instance, book its weights and put it in service
    (`started`: its state already says loading). On any failure the instance is failed with the
    reason and holds nothing; returns success. With `may_wait`, an instance that turns out not
    to fit beside what is loaded now (its size was unknown before loading) is unloaded again,
    not failed: with its size known, residency makes room and loads it again."""
    booked = False
    try:
        if not started:
            instance.begin_load()
        booked = await _load_instance(deployment, instance, scheduler)
        return True
    except NoRoomYet as exc:
        if not may_wait:
            await _unload_quietly(instance)
            instance.fail(f"{type(exc).__name__}: {exc}")
            return False
        log.info("model %s instance %d: %s; unloading until there is room", deployment.name, instance.index, exc,
                 extra={"model": deployment.name})
        await _unload_quietly(instance)
        instance.begin_unload()
        instance.mark_unloaded()
        return False
    except Exception as exc:
        if booked:
            scheduler.release_weights(instance)
        log.exception("model %s instance %d failed to load", deployment.name, instance.index,
                      extra={"model": deployment.name})
        await _unload_quietly(instance)
        instance.fail(f"{type(exc).__name__}: {exc}", exc)
        return False


async def _unload_quietly(instance: ModelInstance) -> None:
    """Give back what a failed load may hold; errors here are only logged."""
    try:
        await instance.call(instance.plugin.unload)
    except Exception:
        log.warning("model %s instance %d: unload after a failed load raised", instance.model, instance.index,
                    exc_info=True)


async def _load_instance(deployment: Deployment, instance: ModelInstance, scheduler: DeviceScheduler) -> bool:
    name, plugin, config = deployment.name, instance.plugin, deployment.config
    started = instance.clock()
    reload = instance.last_estimate if instance.times.seeded else None  # an earlier load's figures
    await instance.call(plugin.load, instance.device)
    instance.begin_warmup()
    if reload is not None:
        # A reload (on demand, after an eviction) of the same checkpoint: the memory figures and
        # batch timings of the first load still hold, and the framework's lazy set-up was done
        # then, so nothing is estimated, warmed, profiled or timed again.
        estimate = reload
    else:
        estimate = apply_declared(await instance.call(plugin.memory_estimate), config.memory)
        if instance.last_estimate is None:
            instance.last_estimate = estimate  # sizes residency's plans from now on, loaded or not
        scheduler.check_fits(deployment, estimate)  # before warming up: no room means no warm-up wasted
        # Warm-up batches are batches: capped by the budget like any other, before the first one runs.
        estimate = await _warm_up(deployment, instance, estimate, _batch_cap(deployment, estimate))
    limit = _batch_cap(deployment, estimate)  # profiling may have changed the figures
    scheduler.check_fits(deployment, estimate)
    if config.warmup.enabled and reload is None:
        await _time_batches(deployment, instance, sorted({1, limit}))
    scheduler.book_weights(deployment, instance, estimate.weights_bytes)
    instance.mark_ready(estimate, limit)
    log.info(
        "model %s instance %d: ready in %.2fs (weights %d B, per item %d B, %s; max batch %d; batch time %.1f ms"
        " at 1, %.1f ms at %d)",
        name, instance.index, instance.clock() - started, estimate.weights_bytes,
        estimate.per_item_bytes, estimate.source, limit, instance.times.base_s(1) * 1000,
        instance.times.base_s(limit) * 1000, limit, extra={"model": name},
    )
    return True


async def _time_batches(deployment: Deployment, instance: ModelInstance, sizes: list[int]) -> None:
    """Time `predict_batch` on the warmed instance at each size, `TIMING_RUNS` times: the deadline
    gate's first prediction, and the speed its load factor relaxes to, come from the fastest of
    these idle-device timings (`BatchTime.seed`), not from the first batch under load."""
    plugin, clock = instance.plugin, instance.clock

    def measure() -> list[tuple[int, float]]:
        payload = plugin.example_payload()
        if payload is None:
            return []
        item = plugin.preprocess(payload)
        timings = []
        for size in [size for size in sizes for _ in range(TIMING_RUNS)]:
            begun = clock()
            try:
                plugin.predict_batch([item] * size)
            except Exception as exc:  # noqa: BLE001  # best effort: real batches will teach the estimate instead
                log.info("model %s instance %d: timing a batch of %d failed (%s: %s); the first real batches "
                         "will be timed instead", deployment.name, instance.index, size, type(exc).__name__, exc,
                         extra={"model": deployment.name})
                break
            timings.append((size, clock() - begun))
        return timings

    timings = await instance.call(measure)
    instance.times.seed(timings)
    if timings:
        log.info("model %s instance %d: batch timings %s (the fastest of each size counts)", deployment.name,
                 instance.index, ", ".join(f"{n}: {s * 1000:.1f} ms" for n, s in timings),
                 extra={"model": deployment.name})


def _batch_cap(deployment: Deployment, estimate: MemoryEstimate) -> int:
    """The largest batch the model's budget allows with the 20% margin; ModelDoesNotFit below one."""
    limit = max_batch_within(estimate, deployment.budget_bytes, deployment.config.batch.max_size)
    if limit < 1:
        raise ModelDoesNotFit(
            f"model {deployment.name!r} needs {estimate.weights_bytes} bytes of weights plus "
            f"{estimate.batch_bytes(1)} for one input (+20% margin), over its budget of {deployment.budget_bytes}"
        )
    return limit


def warmup_sizes(configured: list[int] | None, max_size: int, cap: int) -> list[int]:
    """The warm-up batch sizes (default 1 and batch.max_size), none above the budget's cap."""
    return sorted({min(size, cap) for size in (configured or [1, max_size])})


async def _warm_up(deployment: Deployment, instance: ModelInstance, estimate: MemoryEstimate, cap: int) -> MemoryEstimate:
    """Warm up with progress lines, at batch sizes within `cap`; on CUDA, profile peak memory per batch size."""
    config, name, plugin = deployment.config, deployment.name, instance.plugin
    if not config.warmup.enabled:
        return estimate
    if cap < config.batch.max_size:
        log.info("model %s: warm-up batches capped at %d by the memory budget", name, cap, extra={"model": name})
    profile = config.memory.profile and type(plugin).torch_memory and estimate.source != "declared"
    if instance.device.startswith("cuda") and profile:

        def progress(step: int, total: int, size: int) -> None:
            log.info("model %s: profiling memory %d/%d (batch %d)", name, step, total, size, extra={"model": name})

        sizes = profile_sizes(cap)
        profiled = await instance.call(profile_cuda, plugin, instance.device, estimate.weights_bytes, sizes, progress)
        if profiled is not None:
            return profiled
    sizes = warmup_sizes(config.warmup.batch_sizes, config.batch.max_size, cap)
    for step, size in enumerate(sizes, start=1):
        log.info("model %s: warm-up %d/%d (batch %d)", name, step, len(sizes), size, extra={"model": name})
        await instance.call(plugin.warmup, size)
    return estimate
