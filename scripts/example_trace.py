"""Print the trace of one request as docs/tracing.md shows it: a real `model-router serve` on a
loopback port exporting OTLP/HTTP to a receiver in this process, four requests sent at once
(the first with a client's traceparent) so that they share a batch, and the first one's trace
rendered as text from the spans received. With `--pipeline`: config/fleet.yaml's detect-classify
on the demo store, bus.jpg and zidane.jpg sent at once, bus.jpg's trace (a stage per step, each
crop's phases and the classifier batch it shared with the other request's crops).

    .venv/bin/python scripts/example_trace.py [--pipeline]
"""

from __future__ import annotations

import json
import sys
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository's test kit, below

from tests.conftest import serve
from tests.otlp_receiver import SERVER, ReceivedSpan, Receiver, receiver, text_tree

FLEET = """
models:
  detector:
    plugin: scripted
    options: {fixed_ms: 20, per_item_ms: 2, per_item_bytes: 4000000, fixed_bytes: 16000000}
    batch: {max_size: 8, max_delay_ms: 25}
"""
CLIENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


REPO = Path(__file__).resolve().parents[1]
T = TypeVar("T")


def at_once(send: Callable[[T], None], each: list[T], timeout_s: float) -> None:
    """`send(x)` for every x, from one thread each, released together (so that they share batches)."""
    together = threading.Barrier(len(each))

    def released(value: T) -> None:
        together.wait(10)
        send(value)

    threads = [threading.Thread(target=released, args=(value,)) for value in each]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout_s)


def server_span(otlp: Receiver, request_id: str) -> ReceivedSpan:
    return otlp.wait_for(lambda got: next((s for s in got if s.kind == SERVER
                                           and s.attributes.get("router.request_id") == request_id), None))


def pipeline() -> int:
    """detect-classify on two photos at once, batch windows widened (300 ms) so that their crops meet."""
    import re

    import ultralytics

    photos = Path(ultralytics.__file__).parent / "assets"
    text = (REPO / "config" / "fleet.yaml").read_text(encoding="utf-8")
    text = text.replace("model_store: ../model_store", f"model_store: {REPO / 'model_store'}")
    text = re.sub(r"max_delay_ms: \d+", "max_delay_ms: 300", text)
    with receiver() as otlp, tempfile.TemporaryDirectory() as tmp:
        env = {"OTEL_EXPORTER_OTLP_ENDPOINT": otlp.url, "OTEL_BSP_SCHEDULE_DELAY": "50"}
        with serve(Path(tmp), text, env=env, timeout=180) as server:
            def one(photo: str) -> None:
                httpx.post(f"{server.url}/models/detect-classify/predict", content=(photos / photo).read_bytes(),
                           headers={"content-type": "image/jpeg", "x-request-id": photo.removesuffix(".jpg")},
                           timeout=120).raise_for_status()

            at_once(one, ["bus.jpg", "zidane.jpg"], 150)
            root = server_span(otlp, "bus")
            otlp.wait_for(lambda got: all(link.span_id in {b.span_id for b in got} for s in got
                                          if s.trace_id == root.trace_id and s.name == "execute" for link in s.links)
                          and any(s.name == "execute" and s.trace_id == root.trace_id for s in got))
            print(text_tree(otlp.spans, root))
    return 0


def main() -> int:
    if "--pipeline" in sys.argv[1:]:
        return pipeline()
    with receiver() as otlp, tempfile.TemporaryDirectory() as tmp:
        env = {"OTEL_EXPORTER_OTLP_ENDPOINT": otlp.url, "OTEL_BSP_SCHEDULE_DELAY": "50"}
        with serve(Path(tmp), FLEET, env=env) as server:
            def one(index: int) -> None:
                headers = {"content-type": "application/json", "x-request-id": f"req-{index}"}
                if index == 0:
                    headers["traceparent"] = CLIENT
                httpx.post(f"{server.url}/models/detector/predict", content=json.dumps({"id": str(index)}),
                           headers=headers, timeout=30).raise_for_status()

            at_once(one, list(range(4)), 30)
            root = server_span(otlp, "req-0")
            otlp.wait_for(lambda got: any(link.span_id == root.span_id for s in got for link in s.links))  # its batch
            print(text_tree(otlp.spans, root))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
