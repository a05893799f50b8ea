"""The floor a front is measured against: a bare Litestar handler that reads the same JSON body the
no-op model gets and answers a small JSON document, on the same uvicorn (httptools, uvloop), with
no router at all: no limits, no request ids, no access lines, no queue, no model.

    python -m benchmarks.bare_litestar --port 8003
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import uvicorn
from litestar import Litestar, Request, get, post

__all__ = ["app"]


@post("/models/noop/predict", status_code=200)
async def predict(request: Request[Any, Any, Any]) -> dict[str, Any]:
    document = json.loads(await request.body())
    return {"model": "noop", "result": {"id": document.get("id"), "batch": 1}}


@get("/health/ready")
async def ready() -> dict[str, str]:
    return {"status": "ready"}


app = Litestar([predict, ready], logging_config=None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args()
    uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="warning", access_log=False, http="httptools",
                lifespan="on", ws="none")


if __name__ == "__main__":
    main()
