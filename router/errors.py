"""Error hierarchy: each class carries its HTTP status, its `outcome` label (metrics, logs) and
its retry hint, so errors map to HTTP in one handler. Where the Open Inference Protocol (KServe
V2) answers differently, the one table `V2_STATUS` below says so; `GRPC_CODES` maps the same
statuses to gRPC's codes."""

from __future__ import annotations

import asyncio
import json
import reprlib
from collections.abc import Mapping
from typing import ClassVar, Final

__all__ = [
    "GRPC_CODES",
    "V2_STATUS",
    "BatchSizeMismatch",
    "ClientDisconnected",
    "ConfigError",
    "Conflict",
    "DeadlineExceeded",
    "DeviceOutOfMemory",
    "EngineUnavailable",
    "ExecutionTimeout",
    "Forbidden",
    "InputError",
    "InstanceLost",
    "ModelChanged",
    "ModelDoesNotFit",
    "ModelError",
    "ModelNotFound",
    "ModelUnavailable",
    "NoSpareCapacity",
    "Overloaded",
    "PayloadTooLarge",
    "PluginValidationError",
    "QueueFull",
    "RegionNotFound",
    "ReplicaLost",
    "RequestTimeout",
    "RouterError",
    "ShuttingDown",
    "Unauthorized",
    "Unimplemented",
    "UnknownPlugin",
    "UnsupportedMediaType",
    "brief",
    "clip",
    "error_named",
    "grpc_code",
    "grpc_status",
    "outcome_of",
    "undecodable",
    "v2_status",
    "with_detail",
]


class RouterError(Exception):
    """An error that answers one request. `status_code` is what HTTP callers see, `outcome` the
    label of the request in metrics and logs, `retry_after_s` when a retry may succeed."""

    status_code: ClassVar[int] = 500
    outcome: ClassVar[str] = "error"

    def __init__(
        self, detail: str, *, headers: Mapping[str, str] | None = None, retry_after_s: float | None = None
    ) -> None:
        super().__init__(detail)
        self.detail = detail
        self.retry_after_s = retry_after_s
        self.headers: dict[str, str] = dict(headers or {})
        if retry_after_s is not None:
            self.headers["Retry-After"] = str(max(1, int(retry_after_s + 0.999)))


class InputError(RouterError):
    """The request itself is wrong: bad data, bad header, bad field."""

    status_code = 400
    outcome = "bad_input"


class PayloadTooLarge(InputError):
    status_code = 413


class UnsupportedMediaType(InputError):
    status_code = 415


class RequestTimeout(InputError):
    """The client sent its request too slowly. The connection is closed after the answer."""

    status_code = 408

    def __init__(self, detail: str) -> None:
        super().__init__(detail, headers={"Connection": "close"})


class ClientDisconnected(RouterError):
    """The client went away before its answer: nginx's 499, for the access log and metrics only."""

    status_code = 499
    outcome = "cancelled"


class Unauthorized(RouterError):
    status_code = 401
    outcome = "unauthorized"

    def __init__(self, detail: str) -> None:
        super().__init__(detail, headers={"WWW-Authenticate": 'Bearer realm="model-router"'})


class Forbidden(RouterError):
    status_code = 403
    outcome = "forbidden"


class ModelNotFound(RouterError):
    status_code = 404
    outcome = "not_found"


class RegionNotFound(RouterError):
    """No shared memory region of that name is registered."""

    status_code = 404
    outcome = "not_found"


class Unimplemented(RouterError):
    """A part of the protocol this server does not serve (CUDA shared memory, trace settings)."""

    status_code = 501
    outcome = "unsupported"


class Conflict(RouterError):
    """An operator's change that would break what depends on it (a model a pipeline uses)."""

    status_code = 409
    outcome = "conflict"


class Overloaded(RouterError):
    """Temporarily unable to take the request; the caller should retry later."""

    status_code = 503
    outcome = "unavailable"

    def __init__(self, detail: str, *, retry_after_s: float | None = None) -> None:
        super().__init__(detail, retry_after_s=retry_after_s)


class QueueFull(Overloaded):
    """The queue is full, or the work ahead would push the request past its deadline."""

    outcome = "rejected_full"


class ShuttingDown(Overloaded):
    outcome = "rejected_shutdown"


class NoSpareCapacity(Overloaded):
    """A mirrored (shadow) copy found no spare capacity: real requests wait on its model or device,
    or one took its place in the queue. Nobody retries it; it is never a user's failure."""

    outcome = "shed"


class ModelUnavailable(Overloaded):
    """The model is not loaded, is still warming up, or failed to load."""


class ModelChanged(ModelUnavailable):
    """A new version of the model took over while a front process prepared the input for the old
    one; the front prepares it again (a client sees this only if that fails too)."""


class EngineUnavailable(Overloaded):
    """The engine process is gone or restarting; the front processes answer this until it is back."""

    outcome = "engine_unavailable"


class InstanceLost(ModelUnavailable):
    """The process that ran the model's instance died (`isolation: process`); it is restarting."""

    outcome = "instance_lost"


class ReplicaLost(Overloaded):
    """The cluster replica holding the request died or became unreachable (Ray restarts it)."""

    outcome = "replica_lost"


class DeviceOutOfMemory(Overloaded):
    """A plugin may raise this for an out-of-memory condition its framework reports differently."""

    outcome = "out_of_memory"


class ModelDoesNotFit(Overloaded):
    """The model can never fit its devices' or its own memory budget (not an out-of-memory)."""

    outcome = "does_not_fit"


class DeadlineExceeded(RouterError):
    status_code = 504
    outcome = "deadline"


class ExecutionTimeout(DeadlineExceeded):
    outcome = "execution_timeout"


class ModelError(RouterError):
    """The model raised while running a batch (or in a hook: the detail names plugin and hook)."""

    status_code = 500


class BatchSizeMismatch(ModelError):
    pass


#: Where KServe V2 answers with another status than the native API: a deadline that expired
#: before the input ran is 503 + Retry-After there, as V2 clients expect of a server too busy to
#: answer in time. A batch that overran its execution timeout stays 504: retrying the same input
#: may overrun again. A part of the protocol not served (CUDA shared memory) is 400, as Triton
#: answers it over HTTP (gRPC's UNIMPLEMENTED comes from the native 501). Looked up by the error's
#: class, most specific first.
V2_STATUS: Final[dict[type[RouterError], tuple[int, float | None]]] = {
    ExecutionTimeout: (504, None),
    DeadlineExceeded: (503, 1.0),
    Unimplemented: (400, None),
}


def v2_status(error: RouterError) -> tuple[int, dict[str, str]]:
    """The V2 status and headers of an error."""
    for cls in type(error).__mro__:
        if cls in V2_STATUS:
            status, retry = V2_STATUS[cls]
            headers = dict(error.headers)
            if retry is not None:
                headers.setdefault("Retry-After", str(max(1, int(retry + 0.999))))
            return status, headers
    return error.status_code, dict(error.headers)


#: gRPC's status codes (their names in grpc.StatusCode) for the statuses above: what a gRPC client
#: sees for each error. An expired deadline is DEADLINE_EXCEEDED (the HTTP native status, not V2's
#: 503), and a 503's retry hint travels in trailing metadata (`grpc_status`). A 409 (an operator's
#: change refused because something depends on it: a model a pipeline uses) is FAILED_PRECONDITION,
#: gRPC's code for "not in the state the operation needs; do not retry until that state is fixed"
#: (its own example: rmdir of a directory that is not empty); ABORTED is for a concurrency conflict
#: that a retry of the read-modify-write may resolve, which this is not.
GRPC_CODES: Final[dict[int, str]] = {
    400: "INVALID_ARGUMENT", 401: "UNAUTHENTICATED", 403: "PERMISSION_DENIED", 404: "NOT_FOUND",
    408: "DEADLINE_EXCEEDED", 409: "FAILED_PRECONDITION", 413: "RESOURCE_EXHAUSTED", 415: "INVALID_ARGUMENT",
    499: "CANCELLED", 500: "INTERNAL", 501: "UNIMPLEMENTED", 503: "UNAVAILABLE", 504: "DEADLINE_EXCEEDED",
}


def grpc_code(status: int) -> str:
    """The gRPC code name of a router status: OK below 400, else from `GRPC_CODES`."""
    if status < 400:
        return "OK"
    return GRPC_CODES.get(status, "UNKNOWN" if status < 500 else "INTERNAL")


def grpc_status(error: RouterError) -> tuple[str, dict[str, str]]:
    """The gRPC code name and trailing metadata of an error: `retry-after` (seconds, as the HTTP
    header) and `grpc-retry-pushback-ms` (read by gRPC's own retry policy) when a retry may succeed
    (every 503: one second where the error names no time)."""
    code = grpc_code(error.status_code)
    retry = error.retry_after_s if error.retry_after_s is not None else (1.0 if error.status_code == 503 else None)
    if retry is None:
        return code, {}
    return code, {"retry-after": str(max(1, int(retry + 0.999))), "grpc-retry-pushback-ms": str(int(retry * 1000))}


def with_detail(error: RouterError, detail: str) -> RouterError:
    """The same error (class, status, outcome, retry hint) with another detail. A batch's error
    is shared by all its requests, so an error is never edited in place."""
    copy = type(error).__new__(type(error))
    RouterError.__init__(copy, detail, headers=error.headers)
    copy.retry_after_s = error.retry_after_s
    return copy


def undecodable(error: BaseException) -> InputError | None:
    """The InputError that a plugin's failure to decode one input stands for, or None (a plugin
    bug): a RecursionError (the input nests deeper than a recursive parser can follow, such as
    `json.loads`), a JSON or a Unicode decoding error."""
    if isinstance(error, RecursionError):
        return InputError(f"the input could not be decoded: it nests too deeply ({type(error).__name__})")
    if isinstance(error, (json.JSONDecodeError, UnicodeDecodeError)):
        return InputError(f"the input could not be decoded: {type(error).__name__}: {clip(str(error), 200)}")
    return None


def outcome_of(error: BaseException) -> str:
    """The `outcome` label of a failed request."""
    if isinstance(error, RouterError):
        return error.outcome
    if isinstance(error, asyncio.CancelledError):
        return "cancelled"
    return "error"


def error_named(kind: str, detail: str, *, headers: Mapping[str, str] | None = None,
                retry_after_s: float | None = None) -> RouterError:
    """A RouterError rebuilt from its class name, detail and headers, as another process or a
    replica sent it: it answers with the same status, outcome and headers. An unknown name is a
    ModelError (500)."""
    error_class = _ERRORS_BY_NAME.get(kind, ModelError)
    error = RouterError.__new__(error_class)
    RouterError.__init__(error, detail, headers=headers, retry_after_s=retry_after_s)
    return error


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


def brief(value: object, limit: int = 80) -> str:
    """A repr of a client's or a config file's value for an error message: at most `limit`
    characters, and cheap however long or deeply nested the value is (a 10 MB string, a YAML alias
    bomb, a 5,000-digit integer)."""
    shown = reprlib.Repr()
    shown.maxlevel, shown.maxstring, shown.maxother, shown.maxlong = 3, max(limit, 8), max(limit, 8), 40
    shown.maxlist = shown.maxtuple = shown.maxdict = shown.maxset = 6
    try:
        text = shown.repr(value)
    except Exception:  # noqa: BLE001  # an integer too long for str(), a broken __repr__
        text = f"<{type(value).__name__}>"
    return text if len(text) <= limit else text[:limit - 3] + "..."


def clip(text: str, limit: int = 300) -> str:
    """Text cut to at most `limit` characters, marked with '...' where it was cut."""
    return text if len(text) <= limit else text[:limit - 3] + "..."


#: Every RouterError class by name, for `error_named`.
_ERRORS_BY_NAME: Final[dict[str, type[RouterError]]] = {
    cls.__name__: cls for cls in list(globals().values())
    if isinstance(cls, type) and issubclass(cls, RouterError)
}
