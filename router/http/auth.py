"""The HTTP side of access control: a Litestar guard that checks each route's declared access level
against the app's `router.access.AccessPolicy` (the policy every front shares)."""

from __future__ import annotations

from typing import Any

from litestar.connection import ASGIConnection
from litestar.handlers.base import BaseRouteHandler

from router.access import Access, AccessPolicy, policy_from_settings, read_keys

__all__ = ["Access", "AccessPolicy", "access_guard", "policy_from_settings", "read_keys"]


async def access_guard(connection: ASGIConnection[Any, Any, Any, Any], handler: BaseRouteHandler) -> None:
    """App-wide Litestar guard: the route's declared access level against the app's policy.
    Async, so Litestar calls it on the event loop instead of handing it to a thread."""
    policy: AccessPolicy = connection.app.state.access_policy
    access = handler.opt.get("access")
    if access is None:
        access = Access.OPEN if connection.scope["path"].startswith("/schema") else Access.PREDICT
    policy.check(Access(access), tuple(connection.headers.getall("authorization", ())))
