"""Error hierarchy. Each class carries its HTTP status, so mapping to HTTP happens in one handler."""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar

__all__ = [
    "BatchSizeMismatch",
    "ConfigError",
    "DeadlineExceeded",
    "DeviceOutOfMemory",
    "ExecutionTimeout",
    "Forbidden",
    "InputError",
    "ModelDoesNotFit",
    "ModelError",
    "ModelNotFound",
    "ModelUnavailable",
    "Overloaded",
    "PayloadTooLarge",
    "PluginValidationError",
    "QueueFull",
    "RouterError",
    "ShuttingDown",
    "Unauthorized",
    "UnknownPlugin",
    "UnsupportedMediaType",
]


class RouterError(Exception):
    """An error that answers one request. `status_code` is what HTTP callers see."""

    status_code: ClassVar[int] = 500

    def __init__(self, detail: str, *, headers: Mapping[str, str] | None = None) -> None:
        super().__init__(detail)
        self.detail = detail
        self.headers: dict[str, str] = dict(headers or {})


class InputError(RouterError):
    """The request itself is wrong: bad data, bad header, bad field."""

    status_code = 400


class PayloadTooLarge(InputError):
    status_code = 413


class UnsupportedMediaType(InputError):
    status_code = 415


class Unauthorized(RouterError):
    status_code = 401

    def __init__(self, detail: str) -> None:
        super().__init__(detail, headers={"WWW-Authenticate": 'Bearer realm="model-router"'})


class Forbidden(RouterError):
    status_code = 403


class ModelNotFound(RouterError):
    status_code = 404


class Overloaded(RouterError):
    """Temporarily unable to take the request; the caller should retry later."""

    status_code = 503

    def __init__(self, detail: str, *, retry_after_s: float | None = None) -> None:
        headers = {}
        if retry_after_s is not None:
            headers["Retry-After"] = str(max(1, int(retry_after_s + 0.999)))
        super().__init__(detail, headers=headers)
        self.retry_after_s = retry_after_s


class QueueFull(Overloaded):
    pass


class ShuttingDown(Overloaded):
    pass


class ModelUnavailable(Overloaded):
    """The model is not loaded, is still warming up, or failed to load."""


class DeviceOutOfMemory(Overloaded):
    """A plugin may raise this for an out-of-memory condition its framework reports differently."""


class ModelDoesNotFit(Overloaded):
    """The model can never fit its devices' or its own memory budget (not an out-of-memory)."""


class DeadlineExceeded(RouterError):
    status_code = 504


class ExecutionTimeout(DeadlineExceeded):
    pass


class ModelError(RouterError):
    """The model raised while running a batch."""

    status_code = 500


class BatchSizeMismatch(ModelError):
    pass


class ConfigError(Exception):
    """The fleet file or the settings are invalid. The message names file, key, value and what is accepted."""


class PluginValidationError(Exception):
    """A plugin failed validation when it registered."""

    def __init__(self, plugin: str, message: str) -> None:
        super().__init__(f"plugin {plugin!r}: {message}")
        self.plugin = plugin


class UnknownPlugin(KeyError):
    """No plugin of that name is installed."""

    def __init__(self, name: str, installed: list[str], broken: Mapping[str, str] | None = None) -> None:
        listing = ", ".join(sorted(installed)) or "none"
        message = f"no plugin named {name!r} is installed; installed plugins: {listing}"
        if broken and name in broken:
            message = f"plugin {name!r} is installed but failed to load: {broken[name]}"
        super().__init__(message)
        self.message = message

    def __str__(self) -> str:
        return self.message
