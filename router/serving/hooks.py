"""Running a plugin's request-path hooks (preprocess, postprocess, describe_input), off the event
loop unless they are cheap, and never holding a thread for another process.

In-process plugins run on thread pools: preprocessing on the CPU pool, postprocessing on threads
of its own, so the answers of requests already run never queue behind the preparation of new
ones (under load that queue made answers seconds late). A plugin in its own process
(`isolation: process`) is awaited (`RemotePlugin.acall`): a child that stops answering then holds
no thread that other models need.

Handing a call to a thread and back costs the event loop some 30 to 60 us here (a future, a
wake-up of the thread, a wake-up of the loop), and the request two wake-ups. A call that costs
about that much (a JSON field, a short JSON body made a tensor, a small CPU model's batch) is
cheaper to run in place. So each call is timed where it runs (`CallCost`): one whose mean on its
thread is under `TRY_INLINE_BELOW_S` is tried on the event loop, and stays there while its mean
there is under `INLINE_BELOW_S`, or under its mean on the thread plus the hand-off (`HAND_OFF_S`)
and under `TRY_INLINE_BELOW_S`; one that gets dearer goes back to its thread at its next call and
is tried again `RETRY_INLINE_EVERY` calls later. A thread's timing counts its waits for the GIL, which grow
with the load: it is what the request waits too. Image decoding (milliseconds) never runs on the
loop. The same rule places a CPU instance's batches (`router.serving.instance`).

The checks around the hooks are here too: the body's media type on its way in
(`check_media_type`) and the answer on its way out (`check_answer`). Each raises the RouterError
that answers the request; neither has side effects.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from fnmatch import fnmatch
from typing import Any, TypeVar

from router.errors import DeadlineExceeded, ModelError, RouterError, UnsupportedMediaType, clip, undecodable
from router.sdk.plugin import ModelPlugin, Payload
from router.serving.isolation import RemotePlugin

__all__ = ["HAND_OFF_S", "INLINE_AFTER_CALLS", "INLINE_BELOW_S", "RETRY_INLINE_EVERY", "TRIAL_CALLS", "TRY_ENDS_ABOVE_S",
           "TRY_INLINE_BELOW_S", "CallCost", "HookRunner", "check_answer", "check_media_type"]

log = logging.getLogger("router.serving.runtime")  # the request path's logger, as before these hooks moved here
T = TypeVar("T")
#: A call whose mean on the event loop is less than this stays there, whatever its thread's.
INLINE_BELOW_S = 100e-6
#: What handing a call to a thread and back costs the event loop (30 to 60 us here).
HAND_OFF_S = 50e-6
#: A call whose mean on its thread is less than this is tried on the event loop; on the loop, a
#: mean over it sends the call back to its thread.
TRY_INLINE_BELOW_S = 250e-6
#: Calls timed on a thread before a call is first tried on the event loop.
INLINE_AFTER_CALLS = 8
#: Calls on a thread between two tries on the event loop of a call found too dear there.
RETRY_INLINE_EVERY = 256
#: The most calls one try on the event loop lasts before its mean decides.
TRIAL_CALLS = 8
#: A call of a try on the event loop that takes longer than this ends the try at once.
TRY_ENDS_ABOVE_S = 1e-3
DOING = {"preprocess": "preparing the input", "postprocess": "preparing the answer"}
_JSON_SCALARS = (str, int, bool, type(None))


class CallCost:
    """One call's duration where it runs (a model's hook, or a CPU instance's batch): a mean on the
    event loop and a decaying mean (a tenth of each new call) on its thread. Updated from those
    threads too: an estimate, not an account.

    A try on the loop is judged by its own calls, up to `TRIAL_CALLS` of them (their mean): the
    first calls there after a spell on a thread are dearer (caches warmed by the other thread), and
    a pause the call did not cause (a garbage collection) must not decide alone. A call of the try
    over `TRY_ENDS_ABOVE_S` ends it at once. After the try, a decaying mean decides."""

    __slots__ = ("inline_s", "pooled_calls", "pooled_s", "since_inline", "trial_left")

    def __init__(self) -> None:
        self.inline_s: float | None = None  # None: never run on the loop
        self.pooled_s = 0.0
        self.pooled_calls = 0
        self.since_inline = 0  # calls on a thread since it last ran on the loop
        self.trial_left = 0  # calls of the current try on the loop still to come

    def observe(self, seconds: float, *, inline: bool) -> None:
        if inline:
            if self.inline_s is None or self.since_inline > 0:  # a try begins: its own calls judge it
                self.inline_s, self.trial_left = seconds, TRIAL_CALLS - 1
            elif self.trial_left > 0:
                self.inline_s += (seconds - self.inline_s) / (TRIAL_CALLS - self.trial_left + 1)
                self.trial_left -= 1
            else:
                self.inline_s += 0.1 * (seconds - self.inline_s)
            if seconds >= TRY_ENDS_ABOVE_S:
                self.trial_left = 0
            self.since_inline = 0
        else:
            self.pooled_s = seconds if self.pooled_calls == 0 else self.pooled_s + 0.1 * (seconds - self.pooled_s)
            self.pooled_calls += 1
            self.since_inline += 1

    @property
    def inline(self) -> bool:
        """Whether the next call runs on the event loop."""
        if self.inline_s is not None and self.since_inline == 0 and (self.trial_left > 0 or self.cheap_inline):
            return True
        if self.pooled_calls < INLINE_AFTER_CALLS or self.pooled_s >= TRY_INLINE_BELOW_S:
            return False
        return self.inline_s is None or self.since_inline >= RETRY_INLINE_EVERY

    @property
    def cheap_inline(self) -> bool:
        """Its mean on the loop is under `INLINE_BELOW_S`, or under its mean on the thread plus the
        hand-off and under the cap."""
        assert self.inline_s is not None
        return self.inline_s < max(INLINE_BELOW_S, min(self.pooled_s + HAND_OFF_S, TRY_INLINE_BELOW_S))

    def timed(self, inline: bool, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)`, its duration observed as a call on the loop (`inline`) or on a thread."""
        started = time.perf_counter()
        try:
            return fn(*args)
        finally:
            self.observe(time.perf_counter() - started, inline=inline)


class HookRunner:
    """The request path's way to a plugin's hooks; owns the threads they run on."""

    def __init__(self, workers: int, *, name: str = "router", clock: Callable[[], float] = time.monotonic) -> None:
        self._cpu = ThreadPoolExecutor(max(1, workers), thread_name_prefix=f"{name}-cpu")
        self._post = ThreadPoolExecutor(max(1, workers // 2), thread_name_prefix=f"{name}-post")
        self._costs: dict[tuple[str, str], CallCost] = {}
        self._clock = clock

    def shutdown(self) -> None:
        self._cpu.shutdown(wait=False, cancel_futures=True)
        self._post.shutdown(wait=False, cancel_futures=True)

    def cost(self, model: str, hook: str) -> CallCost:
        key = (model, hook)
        cost = self._costs.get(key)
        if cost is None:
            cost = self._costs[key] = CallCost()
        return cost

    async def run(self, model: str, plugin_name: str, plugin: ModelPlugin[Any], hook: str, *args: Any,
                  deadline: float | None = None) -> Any:
        """Run a hook. Its RouterErrors (InputError...) answer the request, and so does a failure
        of preprocess to decode its input (400: `router.errors.undecodable`); anything else is the
        plugin's bug: 500, logged once naming plugin, hook and exception. With `deadline` (on the
        runner's clock), a call not done by then answers 504 (a pool's queue, a slow child)."""
        try:
            if isinstance(plugin, RemotePlugin):
                work = plugin.acall(hook, *args)
            else:
                cost = self.cost(model, hook)
                if cost.inline:
                    return cost.timed(True, getattr(plugin, hook), *args)
                work = self._on(self._post if hook == "postprocess" else self._cpu, cost, getattr(plugin, hook), *args)
            if deadline is None:
                return await work
            task = asyncio.current_task()
            cancels = task.cancelling() if task is not None else 0
            try:
                result = await asyncio.wait_for(work, max(0.0, deadline - self._clock()))
            except TimeoutError:
                raise DeadlineExceeded(f"deadline passed while {DOING.get(hook, hook)} for model {model!r}") from None
            if task is not None and task.cancelling() > cancels:
                # The caller went away as the hook finished: `asyncio.wait_for` (Python 3.11) returns
                # a result ready when the cancellation comes and drops the cancellation, and the
                # caller would go on to queue an input nobody waits for.
                raise asyncio.CancelledError
            return result
        except RouterError:
            raise
        except Exception as exc:
            if hook == "preprocess" and (refused := undecodable(exc)) is not None:
                raise refused from None
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
    async def _on(pool: ThreadPoolExecutor, cost: CallCost, fn: Any, *args: Any) -> Any:
        """Run fn on `pool`. Work whose request was answered (deadline, client gone) before a thread
        picked it up is skipped, not run for nobody."""
        abandoned = [False]  # a flag, not a threading.Event: set on the loop, read once by the pool thread

        def unless_abandoned() -> Any:
            if abandoned[0]:
                raise asyncio.CancelledError
            return cost.timed(False, fn, *args)

        try:
            return await asyncio.get_running_loop().run_in_executor(pool, unless_abandoned)
        except BaseException:
            abandoned[0] = True
            raise


def check_media_type(model: str, accepts: Sequence[str], payload: Payload) -> None:
    """415 for a media type the model's plugin does not accept."""
    media = payload.media_type.split(";", 1)[0].strip().lower()
    images = any(a.startswith("image/") for a in accepts)
    if images and (payload.pixels is not None or media == "application/octet-stream"):
        return  # decoded pixels, or bytes of unknown type: the plugin sniffs the real format
    accepted = _accepted if len(media) <= 128 else _accepted.__wrapped__  # a long one is not kept
    if not accepted(media, tuple(accepts)):
        raise UnsupportedMediaType(
            f"model {model!r} does not accept {clip(media, 80) or 'an empty media type'}; "
            f"accepted: {', '.join(accepts)}"
        )


@functools.lru_cache(maxsize=256)
def _accepted(media: str, accepts: tuple[str, ...]) -> bool:
    """Whether `media` matches one of the patterns; remembered for the few types clients send."""
    return any(fnmatch(media, pattern) for pattern in accepts)


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
