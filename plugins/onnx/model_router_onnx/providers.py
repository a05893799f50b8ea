"""Which onnxruntime execution providers a device gets: a pure function of the device, what the
installed onnxruntime offers, and whether TensorRT's libraries are present."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from model_router_engines.metadata import BatchProfile

from router.sdk import device_index

__all__ = ["CPU", "CUDA", "TENSORRT", "ProviderError", "choose_providers"]

CPU = "CPUExecutionProvider"
CUDA = "CUDAExecutionProvider"
TENSORRT = "TensorrtExecutionProvider"

Provider = tuple[str, dict[str, Any]]


class ProviderError(RuntimeError):
    """The device cannot be served by the installed onnxruntime."""


def choose_providers(
    device: str,
    available: Sequence[str],
    *,
    tensorrt_libs: bool = False,
    use_tensorrt: bool = True,
    fp16: bool = False,
    profile: tuple[str, Sequence[int], BatchProfile] | None = None,
    cache_dir: str | None = None,
) -> list[Provider]:
    """Providers in priority order, with their options.

    cpu: CPU only. cuda:N: TensorRT EP first when onnxruntime offers it, TensorRT's libraries are
    present (`tensorrt_libs`) and `use_tensorrt`; then CUDA; then CPU for any operator the GPU
    providers lack. `profile` (input name, shape without batch, batch profile) gives the TensorRT
    EP the same optimisation profile a TensorRT engine build would use.
    """
    index = device_index(device)
    if index is None:
        return [(CPU, {})]
    if CUDA not in available:
        raise ProviderError(
            f"device {device!r} needs onnxruntime's {CUDA}, but the installed onnxruntime offers only "
            f"{', '.join(available) or 'nothing'}; install onnxruntime-gpu in place of onnxruntime, or use device: cpu"
        )
    chosen: list[Provider] = []
    if use_tensorrt and tensorrt_libs and TENSORRT in available:
        chosen.append((TENSORRT, _tensorrt_options(index, fp16, profile, cache_dir)))
    chosen.append((CUDA, {"device_id": index}))
    chosen.append((CPU, {}))
    return chosen


def _tensorrt_options(
    index: int, fp16: bool, profile: tuple[str, Sequence[int], BatchProfile] | None, cache_dir: str | None
) -> dict[str, Any]:
    options: dict[str, Any] = {"device_id": index, "trt_fp16_enable": fp16}
    if cache_dir is not None:
        options.update(trt_engine_cache_enable=True, trt_engine_cache_path=cache_dir)
    if profile is not None:
        name, shape, batch = profile

        def spec(n: int) -> str:
            return f"{name}:{'x'.join(str(d) for d in (n, *shape))}"

        options.update(
            trt_profile_min_shapes=spec(batch.min),
            trt_profile_opt_shapes=spec(batch.opt),
            trt_profile_max_shapes=spec(batch.max),
        )
    return options
