"""The common single-queue design, as a contender: the FastAPI pattern.

One `asyncio.Queue(maxsize=100)` and one consumer that runs each item, alone, through
`run_in_executor` (preprocess, predict, postprocess). A full queue answers 503 at once; an
answer not ready within 10 s answers 504. No batching, no deadlines inside the queue.

    python -m benchmarks.single_queue --workload tiny --port 8001 --store model_store
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse

from benchmarks.workloads import build_plugin, server_arguments
from router.sdk.plugin import ModelPlugin, Payload

__all__ = ["QUEUE_SIZE", "SUBMIT_TIMEOUT_S", "make_app"]

QUEUE_SIZE = 100
SUBMIT_TIMEOUT_S = 10.0


def make_app(plugin: ModelPlugin[Any]) -> FastAPI:
    """The app: POST /predict with the raw body, GET /health."""
    queue: asyncio.Queue[tuple[Payload, asyncio.Future[Any]]] = asyncio.Queue(maxsize=QUEUE_SIZE)

    def run_one(payload: Payload) -> Any:
        item = plugin.preprocess(payload)
        return plugin.postprocess(plugin.predict_batch([item])[0], item)

    async def consume() -> None:
        loop = asyncio.get_running_loop()
        while True:
            payload, future = await queue.get()
            try:
                result = await loop.run_in_executor(None, run_one, payload)
            except Exception as exc:  # noqa: BLE001 - the caller gets a 500; the consumer carries on
                if not future.done():
                    future.set_exception(exc)
            else:
                if not future.done():
                    future.set_result(result)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        consumer = asyncio.create_task(consume())
        yield
        consumer.cancel()

    app = FastAPI(lifespan=lifespan)

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.post("/predict")
    async def predict(request: Request) -> Response:
        payload = Payload(await request.body(), request.headers.get("content-type", ""))
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        try:
            queue.put_nowait((payload, future))
        except asyncio.QueueFull:
            return JSONResponse({"detail": "queue full"}, status_code=503, headers={"Retry-After": "1"})
        try:
            result = await asyncio.wait_for(future, SUBMIT_TIMEOUT_S)
        except TimeoutError:
            return JSONResponse({"detail": "timed out"}, status_code=504)
        return JSONResponse({"result": result})

    return app


def main() -> None:
    import uvicorn

    workload, port, store, _ = server_arguments(__doc__)
    plugin = build_plugin(workload, store)
    uvicorn.run(make_app(plugin), host="127.0.0.1", port=port, log_level="warning", access_log=False)


if __name__ == "__main__":
    main()
