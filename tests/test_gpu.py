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

from router.scheduling.memory import NvmlProbe
from router.sdk.plugin import MemoryEstimate, ModelPlugin, Payload
from router.serving.plan import load_plan
from router.serving.profiling import profile_cuda, profile_sizes
from router.serving.registry import PluginRegistry
from router.serving.runtime import in_process

pytestmark = pytest.mark.gpu


MiB = 2**20


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The demo checkpoints, built here: the repository's model_store/ may not be on the GPU host."""
    from router.store import init_demo

    path = tmp_path_factory.mktemp("model_store")
    init_demo(path, progress=lambda line: None)
    return path


def test_nvml_probe_agrees_with_cuda(record_property: Any) -> None:
    probe = NvmlProbe("cuda:0")
    try:
        reading = probe.read()
    finally:
        probe.close()
    free, total = torch.cuda.mem_get_info(0)
    record_property("figure", f"NVML used {reading.used_bytes / MiB:.0f} of {reading.total_bytes / MiB:.0f} MiB; "
                              f"torch.cuda.mem_get_info used {(total - free) / MiB:.0f} of {total / MiB:.0f} MiB; "
                              f"difference {(reading.used_bytes - (total - free)) / MiB:+.0f} MiB")
    assert reading.total_bytes == total
    assert abs(reading.used_bytes - (total - free)) < 512 * MiB


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


def test_cuda_profile_fits_the_per_item_cost(record_property: Any) -> None:
    plugin = BlockPlugin(BlockPlugin.Options(), None)  # type: ignore[arg-type]
    plugin.load("cuda:0")
    estimate = profile_cuda(plugin, "cuda:0", 64 * 2**20, profile_sizes(8))
    assert estimate is not None and estimate.source == "profiled"
    record_property("figure", f"profiled {estimate.per_item_bytes / MiB:.1f} MiB per item for the "
                              f"{BlockPlugin.block / MiB:.0f} MiB each item allocates")
    assert abs(estimate.per_item_bytes - BlockPlugin.block) / BlockPlugin.block < 0.05


class HugePlugin(BlockPlugin):
    """One item takes 40% of the card: a batch of four cannot fit and raises a real CUDA OOM."""

    def load(self, device: str) -> None:
        super().load(device)
        self.block = int(torch.cuda.get_device_properties(self.device).total_memory * 0.4)

    def example_payload(self) -> None:  # type: ignore[override]
        return None


def test_real_cuda_out_of_memory_is_split_and_retried(tmp_path: Path, record_property: Any) -> None:
    registry = PluginRegistry.from_entry_points()
    registry.register("huge", HugePlugin)
    config = tmp_path / "fleet.yaml"
    config.write_text(
        "devices:\n  cuda:0: {probe: none, memory_budget: 1000GB}\n"
        "models:\n  m: {plugin: huge, device: 'cuda:0', batch: {max_size: 4, max_delay_ms: 200}}\n"
    )

    async def run() -> list[Any]:
        runtime = in_process(load_plan(config, registry))
        await runtime.start()
        await runtime.core.wait_loaded()
        try:
            answers = await asyncio.gather(*(
                runtime.submit("m", Payload(json.dumps({"id": str(i)}).encode(), "application/json")) for i in range(4)
            ))
            return [answers, list(HugePlugin.sizes)]
        finally:
            await runtime.drain(1)
            await runtime.stop()

    answers, sizes = asyncio.run(run())
    total = torch.cuda.get_device_properties(0).total_memory
    record_property("figure", f"batch sizes run {sizes} (an item takes 40% of {total / 2**30:.1f} GiB); "
                              f"{len(answers)} of 4 answered in order")
    assert [a.output for a in answers] == ["0", "1", "2", "3"]
    assert sizes[0] == 4 and max(sizes[1:]) <= 2


def test_residency_on_a_gpu_evicts_by_nvml_and_memory_comes_back(
    tmp_path: Path, store: Path, record_property: Any
) -> None:
    """Three on-demand ResNet-18s on cuda:0 (declared at 102 MB of weights each) in a budget that
    holds two beside what the card uses now: round robin loads and evicts, every request is
    answered, and each unload shows in NVML."""
    from router.scheduling.memory import NvmlProbe as Probe

    probe = Probe("cuda:0")
    used_now = probe.read().used_bytes
    probe.close()
    weights = 102_000_000  # declared: makes two fit and three not, whatever the card holds
    budget = used_now + 2 * weights + 1_500_000_000  # two models and their batches, not three
    models = "".join(
        f"  r{i}: {{plugin: resnet, device: 'cuda:0', options: {{arch: resnet18, weights: resnet18.pt}}, "
        f"residency: on_demand, memory: {{weights: {weights}, per_item: 20MB}}}}\n" for i in range(3)
    )
    config = tmp_path / "fleet.yaml"
    config.write_text(f"model_store: {store}\ndevices:\n  cuda:0: {{probe: nvml, memory_budget: {budget}}}\n"
                      f"models:\n{models}")
    body = (Path(__file__).resolve().parents[1] / "examples" / "street.jpg").read_bytes()

    async def run() -> tuple[list[Any], list[Any]]:
        runtime = in_process(load_plan(config))
        await runtime.start()
        await runtime.core.wait_loaded()
        try:
            answers = []
            for round_ in range(4):
                answers += await asyncio.gather(*(runtime.submit(f"r{i}", Payload(body, "image/jpeg"))
                                                  for i in range(3)))
            return answers, runtime.models()
        finally:
            await runtime.drain(2)
            await runtime.stop()

    answers, models_after = asyncio.run(run())
    assert len(answers) == 12
    evictions = sum(sum(m.residency.evictions.values()) for m in models_after if m.residency)
    assert evictions >= 1
    returned = [m.residency.last_unload_returned_bytes for m in models_after
                if m.residency and m.residency.last_unload_returned_bytes is not None]
    record_property("figure", f"{len(answers)} answered, {evictions} evictions, last unloads returned "
                              f"{[round(r / MiB) for r in returned]} MiB")
    assert returned and all(r > 0 for r in returned)
