"""Checks that need a CUDA GPU: real NVML readings, CUDA memory profiling, a real CUDA out-of-memory.
They skip here without a GPU; scripts/gpu-check.sh runs them on a machine with one."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch

from router.cli import build_plan
from router.scheduling.probes import NvmlProbe
from router.sdk.plugin import MemoryEstimate, ModelPlugin, Payload
from router.serving.profiling import profile_cuda, profile_sizes
from router.serving.registry import PluginRegistry
from router.serving.runtime import Runtime

pytestmark = pytest.mark.gpu


def test_nvml_probe_agrees_with_cuda() -> None:
    probe = NvmlProbe("cuda:0")
    try:
        reading = probe.read()
    finally:
        probe.close()
    free, total = torch.cuda.mem_get_info(0)
    assert reading.total_bytes == total
    assert abs(reading.used_bytes - (total - free)) < 512 * 2**20


class BlockPlugin(ModelPlugin):  # type: ignore[type-arg]
    """Allocates `block` bytes per item on the GPU, so memory use is known exactly."""

    accepts = ("application/json",)
    block = 256 * 2**20
    sizes: ClassVar[list[int]] = []  # batch sizes run, across instances (read by the test)

    def load(self, device: str) -> None:
        self.device = torch.device(device)
        self.weights = torch.zeros(64 * 2**20 // 4, device=self.device)
        type(self).sizes.clear()

    def preprocess(self, payload: Payload) -> str:
        return str(json.loads(payload.body)["id"])

    def predict_batch(self, items: Sequence[Any]) -> list[Any]:
        self.sizes.append(len(items))
        scratch = torch.ones(len(items) * self.block // 4, device=self.device)
        torch.cuda.synchronize(self.device)
        del scratch
        return list(items)

    def memory_estimate(self) -> MemoryEstimate:
        return MemoryEstimate(self.weights.numel() * 4, self.block)

    def example_payload(self) -> Payload:
        return Payload(b'{"id": "warmup"}', "application/json")


def test_cuda_profile_fits_the_per_item_cost() -> None:
    plugin = BlockPlugin(BlockPlugin.Options(), None)  # type: ignore[arg-type]
    plugin.load("cuda:0")
    estimate = profile_cuda(plugin, "cuda:0", 64 * 2**20, profile_sizes(8))
    assert estimate is not None and estimate.source == "profiled"
    assert abs(estimate.per_item_bytes - BlockPlugin.block) / BlockPlugin.block < 0.05


class HugePlugin(BlockPlugin):
    """One item takes 40% of the card: a batch of four cannot fit and raises a real CUDA OOM."""

    def load(self, device: str) -> None:
        super().load(device)
        self.block = int(torch.cuda.get_device_properties(self.device).total_memory * 0.4)

    def example_payload(self) -> None:  # type: ignore[override]
        return None


def test_real_cuda_out_of_memory_is_split_and_retried(tmp_path: Path) -> None:
    registry = PluginRegistry.from_entry_points()
    registry.register("huge", HugePlugin)
    config = tmp_path / "fleet.yaml"
    config.write_text(
        "devices:\n  cuda:0: {probe: none, memory_budget: 1000GB}\n"
        "models:\n  m: {plugin: huge, device: 'cuda:0', batch: {max_size: 4, max_delay_ms: 200}}\n"
    )

    async def run() -> list[Any]:
        runtime = Runtime(build_plan(config, registry))
        await runtime.start()
        await runtime.wait_loaded()
        try:
            answers = await asyncio.gather(*(
                runtime.submit("m", Payload(json.dumps({"id": str(i)}).encode(), "application/json")) for i in range(4)
            ))
            return [answers, list(HugePlugin.sizes)]
        finally:
            await runtime.drain(1)
            await runtime.stop()

    answers, sizes = asyncio.run(run())
    assert [a.output for a in answers] == ["0", "1", "2", "3"]
    assert sizes[0] == 4 and max(sizes[1:]) <= 2
