"""Access control: optional bearer keys for inference, a separate admin key for state changes.

Keys come from the environment or secret files (one key a line), never from the fleet file.
Every presented key is compared with every configured key in constant time.
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any

from litestar.connection import ASGIConnection
from litestar.handlers.base import BaseRouteHandler

from router.config import ServerSettings
from router.errors import ConfigError, Forbidden, Unauthorized

__all__ = ["Access", "AccessPolicy", "access_guard", "policy_from_settings", "read_keys"]


class Access(str, Enum):
    """What a route needs. Handlers declare it with `opt={"access": Access.X}`; predict is the default."""

    OPEN = "open"  # docs
    HEALTH = "health"
    METRICS = "metrics"
    PREDICT = "predict"
    ADMIN = "admin"


def read_keys(inline: str | None, file: Path | None, name: str) -> tuple[bytes, ...]:
    """Keys from a comma-separated value and/or a file with one key a line ('#' starts a comment)."""
    keys = [k.strip() for k in (inline or "").split(",") if k.strip()]
    if file is not None:
        try:
            lines = file.read_text(encoding="utf-8").splitlines()
        except OSError as exc:
            raise ConfigError(f"{name}_FILE: cannot read {str(file)!r}: {exc.strerror or exc}") from exc
        keys += [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]
    for key in keys:
        if len(key) < 16:
            raise ConfigError(f"{name}: every key must be at least 16 characters, got one of {len(key)}")
    return tuple(k.encode() for k in keys)


@dataclass(frozen=True)
class AccessPolicy:
    predict_keys: tuple[bytes, ...] = ()
    admin_keys: tuple[bytes, ...] = ()
    protect_health: bool = False
    protect_metrics: bool = False

    @property
    def enabled(self) -> bool:
        return bool(self.predict_keys or self.admin_keys)

    def check(self, access: Access, authorization: str | None) -> None:
        """Raise Unauthorized (401) or Forbidden (403) unless the presented key grants `access`."""
        if not self.enabled or access is Access.OPEN:
            return
        if (access is Access.HEALTH and not self.protect_health) or (
            access is Access.METRICS and not self.protect_metrics
        ):
            return
        presented = _bearer(authorization)
        is_admin = _matches(presented, self.admin_keys)
        if access is Access.ADMIN:
            if is_admin:
                return
            if _matches(presented, self.predict_keys):
                raise Forbidden("this action needs the admin key")
            raise Unauthorized("an admin key is required: send 'Authorization: Bearer <key>'")
        if not (is_admin or _matches(presented, self.predict_keys)):
            raise Unauthorized("a valid API key is required: send 'Authorization: Bearer <key>'")


def _bearer(header: str | None) -> bytes:
    if not header:
        return b""
    scheme, _, value = header.strip().partition(" ")
    return value.strip().encode() if scheme.lower() == "bearer" else b""


def _matches(presented: bytes, keys: tuple[bytes, ...]) -> bool:
    """Constant time in the key contents: every configured key is compared, no early exit."""
    found = False
    for key in keys:
        found |= hmac.compare_digest(presented, key)
    return found and bool(presented)


async def access_guard(connection: ASGIConnection[Any, Any, Any, Any], handler: BaseRouteHandler) -> None:
    """App-wide Litestar guard: the route's declared access level against the app's policy.
    Async, so Litestar calls it on the event loop instead of handing it to a thread."""
    policy: AccessPolicy = connection.app.state.access_policy
    access = handler.opt.get("access")
    if access is None:
        access = Access.OPEN if connection.scope["path"].startswith("/schema") else Access.PREDICT
    policy.check(Access(access), connection.headers.get("authorization"))


def policy_from_settings(settings: ServerSettings) -> AccessPolicy:
    """The keys and protections the MODEL_ROUTER_* settings ask for."""
    return AccessPolicy(
        predict_keys=read_keys(settings.api_keys, settings.api_keys_file, "MODEL_ROUTER_API_KEYS"),
        admin_keys=read_keys(settings.admin_keys, settings.admin_keys_file, "MODEL_ROUTER_ADMIN_KEYS"),
        protect_health=settings.protect_health,
        protect_metrics=settings.protect_metrics,
    )
