"""Running a plugin's request-path hooks (preprocess, postprocess, describe_input), off the event
loop and never holding a thread for another process.

In-process plugins run on thread pools: preprocessing on the CPU pool, postprocessing on threads
of its own, so the answers of requests already run never queue behind the preparation of new
ones (under load that queue made answers seconds late). A plugin in its own process
(`isolation: process`) is awaited (`RemotePlugin.acall`): a child that stops answering then holds
no thread that other models need.
"""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from router.errors import ModelError, RouterError
from router.sdk.plugin import ModelPlugin, Payload
from router.serving.isolation import RemotePlugin

__all__ = ["HookRunner"]

log = logging.getLogger("router.serving.runtime")  # the request path's logger, as before these hooks moved here
T = TypeVar("T")


class HookRunner:
    """The request path's way to a plugin's hooks; owns the threads they run on."""

    def __init__(self, workers: int) -> None:
        self._cpu = ThreadPoolExecutor(workers, thread_name_prefix="router-cpu")
        self._post = ThreadPoolExecutor(max(1, workers // 2), thread_name_prefix="router-post")

    def shutdown(self) -> None:
        self._cpu.shutdown(wait=False, cancel_futures=True)
        self._post.shutdown(wait=False, cancel_futures=True)

    async def run(self, model: str, plugin_name: str, plugin: ModelPlugin[Any], hook: str, *args: Any) -> Any:
        """Run a hook. Its RouterErrors (InputError...) answer the request; anything else is the
        plugin's bug: 500, logged once naming plugin, hook and exception."""
        try:
            if isinstance(plugin, RemotePlugin):
                return await plugin.acall(hook, *args)
            pool = self._post if hook == "postprocess" else self._cpu
            return await self._on(pool, getattr(plugin, hook), *args)
        except RouterError:
            raise
        except Exception as exc:
            log.error("model %s: plugin %s raised in %s: %s: %s", model, plugin_name, hook, type(exc).__name__, exc,
                      exc_info=exc, extra={"model": model, "plugin": plugin_name, "hook": hook})
            raise ModelError(f"model {model!r}: plugin {plugin_name!r} failed in {hook}: {type(exc).__name__}: {exc}"
                             ) from None

    async def described(self, plugin: ModelPlugin[Any], payload: Payload, item: Any) -> dict[str, Any]:
        """The input's facts for its log line: at once in-process; from the instance's process, awaited
        (a call there must never block the event loop), and left out if it fails."""
        if not isinstance(plugin, RemotePlugin):
            return plugin.describe_input(payload, item)
        try:
            described: dict[str, Any] = await plugin.acall("describe_input", payload, item)
        except (RouterError, RuntimeError) as exc:  # its error, or the plugin's bug as the process reports it
            log.warning("model %s: describe_input failed: %s", plugin.name, exc, extra={"model": plugin.name})
            return {}
        return described

    @staticmethod
    async def _on(pool: ThreadPoolExecutor, fn: Any, *args: Any) -> Any:
        """Run fn on `pool`. Work whose request was answered (deadline, client gone) before a thread
        picked it up is skipped, not run for nobody."""
        abandoned = [False]  # a flag, not a threading.Event: set on the loop, read once by the pool thread

        def unless_abandoned() -> Any:
            if abandoned[0]:
                raise asyncio.CancelledError
            return fn(*args)

        try:
            return await asyncio.get_running_loop().run_in_executor(pool, unless_abandoned)
        except BaseException:
            abandoned[0] = True
            raise
