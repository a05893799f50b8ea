"""Access control for every front (HTTP, gRPC): optional bearer keys for inference, a separate
admin key for state changes.

Keys come from the environment or secret files (one key a line), never from the fleet file.
Every presented key is compared with every configured key in constant time. A request that carries
two `authorization` values is refused (401, UNAUTHENTICATED), whichever of them is right.
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

from router.config import ServerSettings
from router.errors import ConfigError, Forbidden, Unauthorized, clip

__all__ = ["Access", "AccessPolicy", "Authorization", "KeyHolder", "policy_from_settings", "read_keys"]

#: What a request presents: its one `authorization` value (None: none), or every value it carries.
Authorization = str | tuple[str, ...] | None


class Access(str, Enum):
    """What a route or RPC needs. HTTP handlers declare it with `opt={"access": Access.X}`, the gRPC
    service in its table (`router.grpc.service.ACCESS`); predict is the default."""

    OPEN = "open"  # docs
    HEALTH = "health"
    METRICS = "metrics"
    PREDICT = "predict"
    ADMIN = "admin"


def read_keys(inline: str | None, file: Path | None, name: str) -> tuple[bytes, ...]:
    """Keys from a comma-separated value and/or a file with one key a line ('#' starts a comment).

    Fails closed: a setting that is present but holds no key (`' , '`, an empty file) is an error,
    not an open server; and a key must be printable ASCII, as a client can send it in a header.
    Messages never show a key."""
    keys = [k.strip() for k in (inline or "").split(",") if k.strip()]
    if inline is not None and not keys:
        raise ConfigError(f"{name} is set but holds no key; give keys of at least 16 characters, or unset it")
    if file is not None:
        try:
            lines = file.read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError) as exc:
            reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else "not UTF-8 text"
            raise ConfigError(f"{name}_FILE: cannot read {clip(str(file), 200)!r}: {reason}") from None
        from_file = [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]
        if not from_file:
            raise ConfigError(f"{name}_FILE: {clip(str(file), 200)!r} holds no key (empty, or only comments); "
                              "a secret mounted empty would leave the server open")
        keys += from_file
    for index, key in enumerate(keys, 1):
        if not all("!" <= char <= "~" for char in key):
            raise ConfigError(f"{name}: key {index} has a character that is not printable ASCII (or a space); "
                              "clients send keys in a header, so keys are printable ASCII")
        if len(key) < 16:
            raise ConfigError(f"{name}: every key must be at least 16 characters, got one of {len(key)}")
    return tuple(k.encode("ascii") for k in keys)


@dataclass(frozen=True)
class KeyHolder:
    """Who presented a key, for what belongs to a key (shared memory regions): `id` names the key
    without holding it (its SHA-256), '' with no keys set; `admin`: an admin key, or no keys set."""

    id: str
    admin: bool


@dataclass(frozen=True)
class AccessPolicy:
    predict_keys: tuple[bytes, ...] = ()
    admin_keys: tuple[bytes, ...] = ()
    protect_health: bool = False
    protect_metrics: bool = False

    @property
    def enabled(self) -> bool:
        return bool(self.predict_keys or self.admin_keys)

    def check_consistent(self) -> None:
        """Refuse settings that ask for protection no key can give (ConfigError)."""
        if not self.enabled and (self.protect_health or self.protect_metrics):
            which = "MODEL_ROUTER_PROTECT_HEALTH" if self.protect_health else "MODEL_ROUTER_PROTECT_METRICS"
            raise ConfigError(f"{which} is set but no API or admin key is configured; set MODEL_ROUTER_API_KEYS "
                              "or MODEL_ROUTER_ADMIN_KEYS (or their _FILE forms)")

    def describe(self) -> str:
        """One line for the start-up log: which protection is on. Never shows a key."""
        if not self.enabled:
            return "access: open (no API keys set): any client that reaches the port may run inference"
        inference = (f"{len(self.predict_keys)} inference key(s) and the admin keys" if self.predict_keys
                     else "an admin key (no inference keys are set, so inference needs the admin key)")
        admin = (f"state changes need one of {len(self.admin_keys)} admin key(s)" if self.admin_keys
                 else "state changes are refused (no admin keys)")
        return (f"access: keys required; inference and model listing need {inference}; {admin}; "
                f"health {'protected' if self.protect_health else 'open'}, "
                f"metrics {'protected' if self.protect_metrics else 'open'}")

    def check(self, access: Access, authorization: Authorization) -> None:
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

    def holds_key(self, authorization: Authorization) -> bool:
        """Whether the client presents one of the configured keys (inference or admin); False when none is set."""
        try:
            presented = _bearer(authorization)
        except Unauthorized:
            return False
        return _matches(presented, self.admin_keys) | _matches(presented, self.predict_keys)

    def holder(self, authorization: Authorization) -> KeyHolder:
        """The holder of the presented key; Unauthorized (401) for a key that is not one of them."""
        if not self.enabled:
            return KeyHolder("", admin=True)
        presented = _bearer(authorization)
        admin = _matches(presented, self.admin_keys)
        if not (admin or _matches(presented, self.predict_keys)):
            raise Unauthorized("a valid API key is required: send 'Authorization: Bearer <key>'")
        return KeyHolder(hashlib.sha256(presented).hexdigest(), admin)


def _bearer(authorization: Authorization) -> bytes:
    """The key presented; Unauthorized for two or more values, as neither HTTP nor gRPC says which one counts
    (libraries and proxies pick the first or the last: a client must not get a say by sending both)."""
    if isinstance(authorization, tuple):
        if len(authorization) > 1:
            raise Unauthorized(f"send one key ('Authorization: Bearer <key>'); the request carries "
                               f"{len(authorization)} authorization values")
        authorization = authorization[0] if authorization else None
    if not authorization:
        return b""
    scheme, _, value = authorization.strip().partition(" ")
    return value.strip().encode() if scheme.lower() == "bearer" else b""


def _matches(presented: bytes, keys: tuple[bytes, ...]) -> bool:
    """Constant time in the key contents: every configured key is compared, no early exit."""
    found = False
    for key in keys:
        found |= hmac.compare_digest(presented, key)
    return found and bool(presented)


def policy_from_settings(settings: ServerSettings) -> AccessPolicy:
    """The keys and protections the MODEL_ROUTER_* settings ask for. Settings that would leave the
    server open by mistake raise ConfigError (fail closed)."""
    policy = AccessPolicy(
        predict_keys=read_keys(settings.api_keys, settings.api_keys_file, "MODEL_ROUTER_API_KEYS"),
        admin_keys=read_keys(settings.admin_keys, settings.admin_keys_file, "MODEL_ROUTER_ADMIN_KEYS"),
        protect_health=settings.protect_health,
        protect_metrics=settings.protect_metrics,
    )
    policy.check_consistent()
    return policy
