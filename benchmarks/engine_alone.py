"""The engine process alone: its CPU time per request, with no HTTP in the way.

A real engine (`python -m router.host.engine_main`) on a no-op model, and in this process fake
fronts that speak the real protocol over the real socket (`Hello`, `Submit` of a prepared item,
`Reply`), each with `--concurrency` requests outstanding. The engine's CPU time over the run,
from its process times, divided by the requests answered, is the engine's share of a request:
decode, admission, queue, batch dispatch, resolve, encode and write.

    python -m benchmarks.engine_alone --fronts 2 --concurrency 128 --seconds 5 --max-batch 64
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil

from router.config import ServerSettings
from router.host.arena import Arena
from router.host.handover import write_settings
from router.host.messages import Models, Reply, Submit, Terms
from router.host.packing import Packer
from router.host.stream import EngineStream, handshake

__all__ = ["engine_alone"]

REPO = Path(__file__).resolve().parents[1]


async def _front(path: Path, index: int, concurrency: int, seconds: float, counts: list[int]) -> None:
    arena = Arena.create(f"bench-front-{index}", 16 << 20)
    shake = await asyncio.to_thread(handshake, path, index, arena)
    loop = asyncio.get_running_loop()
    waiting: dict[int, asyncio.Future[Reply]] = {}
    generation = [0]

    def on_message(message: Any) -> None:
        if isinstance(message, Reply):
            future = waiting.pop(message.id, None)
            if future is not None:
                future.set_result(message)
        elif isinstance(message, Models):
            generation[0] = next((m.generation for m in message.models if m.name == "noop"), 0)

    stream = EngineStream(shake.frames, on_message, lambda: None)
    await loop.create_unix_connection(lambda: stream, sock=shake.sock)
    for message in shake.early:
        on_message(message)
    packed, _ = Packer(None).pack("bench")
    numbers = itertools.count(1)
    while generation[0] == 0:
        await asyncio.sleep(0.05)
    stop = time.monotonic() + seconds

    async def client() -> None:
        while time.monotonic() < stop:
            number = next(numbers)
            future: asyncio.Future[Reply] = loop.create_future()
            waiting[number] = future
            stream.send(Submit(number, Terms("noop", time.monotonic()), f"r{index}-{number}", generation[0], 10,
                               item=packed))
            reply = await future
            counts[0 if reply.failure is None else 1] += 1

    await asyncio.gather(*(client() for _ in range(concurrency)))
    stream.close()


def _start_engine(directory: Path, max_batch: int) -> subprocess.Popen[bytes]:
    fleet = directory / "fleet.yaml"
    fleet.write_text(f"models:\n  noop:\n    plugin: scripted\n    device: cpu\n"
                     f"    queue: {{max_size: 4096, timeout_ms: 10000}}\n"
                     f"    batch: {{max_size: {max_batch}, max_delay_ms: 0}}\n", encoding="utf-8")
    settings = directory / "settings.json"
    write_settings(ServerSettings(config=fleet), settings)  # what a split host's parent hands its engine
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(directory)}
    with open(directory / "engine.log", "wb") as log:
        return subprocess.Popen([sys.executable, "-m", "router.host.engine_main", "--socket",
                                 str(directory / "engine.sock"), "--parent", str(os.getpid()), "--settings",
                                 str(settings)], env=env, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)


async def _measure(engine: psutil.Process, socket_path: Path, fronts: int, concurrency: int,
                   seconds: float) -> tuple[list[int], float, float]:
    while not socket_path.exists():
        await asyncio.sleep(0.1)
    await asyncio.gather(*(_front(socket_path, i + 1, concurrency, 1.0, [0, 0]) for i in range(fronts)))  # warm
    counts = [0, 0]
    before, started = engine.cpu_times(), time.monotonic()
    await asyncio.gather(*(_front(socket_path, fronts + i + 1, concurrency, seconds, counts) for i in range(fronts)))
    after, ended = engine.cpu_times(), time.monotonic()
    return counts, (after.user + after.system) - (before.user + before.system), ended - started


def engine_alone(fronts: int = 2, concurrency: int = 128, seconds: float = 5.0, max_batch: int = 64) -> dict[str, Any]:
    directory = Path(tempfile.mkdtemp(prefix="engine-alone-"))
    engine = _start_engine(directory, max_batch)
    try:
        counts, cpu_s, wall_s = asyncio.run(asyncio.wait_for(
            _measure(psutil.Process(engine.pid), directory / "engine.sock", fronts, concurrency, seconds), seconds + 120))
    finally:
        engine.terminate()
        engine.wait(30)
    shutil.rmtree(directory, ignore_errors=True)  # kept when the measurement failed: its engine.log says why
    answered = sum(counts)
    return {"fronts": fronts, "concurrency_per_front": concurrency, "max_batch": max_batch, "seconds": seconds,
            "answered": counts[0], "failed": counts[1], "rps": round(answered / wall_s),
            "engine_cpu_us_per_request": round(cpu_s * 1e6 / max(1, answered), 1),
            "engine_cores": round(cpu_s / wall_s, 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--fronts", type=int, default=2)
    parser.add_argument("--concurrency", type=int, default=128)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--max-batch", type=int, default=64)
    args = parser.parse_args()
    print(json.dumps(engine_alone(args.fronts, args.concurrency, args.seconds, args.max_batch)))


if __name__ == "__main__":
    main()
