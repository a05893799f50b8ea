"""What an error answer's body is, wherever it is answered: the app's error handler, the
connection's early refusals (`router.http.early`) and its own limits (`router.http.protocol`)."""

from __future__ import annotations

from typing import Any

__all__ = ["error_body"]


def error_body(detail: str, request_id: str | None = None, *, v2: bool = False) -> dict[str, Any]:
    """`{"detail": ..., "request_id": ...}` on the native routes (the id once a request has one);
    under /v2 the Open Inference Protocol's `{"error": ...}`."""
    if v2:
        return {"error": detail}
    return {"detail": detail} if request_id is None else {"detail": detail, "request_id": request_id}
