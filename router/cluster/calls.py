"""`ReplicaCalls` over Ray: deployment handles to the device replicas and the placement controller.

A prediction goes through `handle.options(multiplexed_model_id=MODEL)`, so Ray's request router
(`ResidencyRouter`) knows the model; Ray's errors become the router's: a replica that died or
cannot be reached is 503 (`ReplicaLost`), one that does not answer in time is 504.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError, RayTaskError
from ray.serve.exceptions import BackPressureError, RequestCancelledError
from ray.serve.handle import DeploymentHandle

from router.cluster.front import PredictCall
from router.cluster.reports import ReplicaReport, Reply
from router.errors import DeadlineExceeded, ModelError, QueueFull, ReplicaLost

__all__ = ["RayCalls"]


class RayCalls:
    def __init__(self, devices: Mapping[str, DeploymentHandle[Any]], placement: DeploymentHandle[Any]) -> None:
        self._devices = dict(devices)
        self._placement = placement

    async def predict(self, node_type: str, call: PredictCall, avoid: tuple[str, ...], wait_s: float) -> Reply:
        handle = self._devices[node_type].options(multiplexed_model_id=call.model)
        response = handle.predict.remote(call.model, call.body, call.media_type, call.filename, priority=call.priority,
                                         timeout_ms=call.timeout_ms, request_id=call.request_id, avoid=avoid,
                                         pixels=call.pixels, wait_for_room=call.wait_for_room,
                                         must_finish=call.must_finish, shadow=call.shadow)
        try:
            reply: Reply = await asyncio.wait_for(_result(response), wait_s)
        except TimeoutError:
            response.cancel()  # type: ignore[no-untyped-call]
            raise DeadlineExceeded(f"no replica answered model {call.model!r} within {wait_s:.1f} s") from None
        except (ActorDiedError, ActorUnavailableError, RayActorError) as exc:
            raise ReplicaLost(f"the replica serving model {call.model!r} was lost ({type(exc).__name__}); "
                              "Ray is replacing it, retry", retry_after_s=1.0) from None
        except BackPressureError:
            raise QueueFull(f"every replica of model {call.model!r} is at its max_ongoing_requests; retry later",
                            retry_after_s=1.0) from None
        except RequestCancelledError:
            raise ReplicaLost(f"the request to model {call.model!r} was cancelled by Ray", retry_after_s=1.0) from None
        except RayTaskError as exc:
            raise ModelError(f"the replica failed on model {call.model!r}: {exc.cause!r}") from None
        return reply

    async def view(self) -> list[ReplicaReport]:
        reports: list[ReplicaReport] = await self._placement.view.remote()
        return reports

    async def admin(self, verb: str, model: str) -> None:
        await self._placement.admin.remote(verb, model)


async def _result(response: object) -> Reply:
    reply: Reply = await response  # type: ignore[misc]
    return reply
