"""A lean HTTP/1.1 load generator that runs in its own process.

Closed loop: `--concurrency C` workers send back to back. Open loop: `--rate R` requests per second
on a fixed schedule, whatever the server does; latency counts from the scheduled send time, so a
slow server cannot hide its queueing (no coordinated omission). Prints one JSON document.

    python -m benchmarks.loadgen --url http://127.0.0.1:8000 \\
        --target '/models/a/predict=application/json:{"id": "x"}' --rate 200 --duration 20
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

__all__ = ["Pool", "Result", "Target", "exchange", "main", "summarise"]


@dataclass(frozen=True)
class Target:
    path: str
    content_type: str
    body: bytes

    @classmethod
    def parse(cls, text: str) -> Target:
        """`PATH=CONTENT_TYPE:BODY`, or `PATH=CONTENT_TYPE:@FILE` to send a file's bytes."""
        path, _, rest = text.partition("=")
        content_type, _, body = rest.partition(":")
        data = Path(body[1:]).read_bytes() if body.startswith("@") else body.encode()
        return cls(path, content_type, data)


@dataclass
class Result:
    target: str
    status: int  # 0 for a transport error
    latency_s: float
    retry_after: bool
    error: str = ""


Conn = tuple[asyncio.StreamReader, asyncio.StreamWriter]
IDLE_LIMIT_S = 3.0  # below uvicorn's 5 s keep-alive timeout: never reuse a connection the server may close


@dataclass
class Pool:
    host: str
    port: int
    idle: list[tuple[Conn, float]] = field(default_factory=list)
    opened: int = 0

    async def acquire(self) -> Conn:
        now = time.perf_counter()
        while self.idle:
            conn, since = self.idle.pop()
            if now - since < IDLE_LIMIT_S:
                return conn
            conn[1].close()
        self.opened += 1
        return await asyncio.open_connection(self.host, self.port)

    def release(self, conn: Conn, reusable: bool) -> None:
        if reusable:
            self.idle.append((conn, time.perf_counter()))
        else:
            conn[1].close()


async def send(pool: Pool, target: Target, headers: dict[str, str], timeout_s: float) -> tuple[int, bool]:
    """One request on a pooled keep-alive connection. Returns (status, has Retry-After)."""
    status, fields, _ = await exchange(pool, target, headers, timeout_s)
    return status, "retry-after" in fields


async def exchange(pool: Pool, target: Target, headers: dict[str, str], timeout_s: float) -> tuple[int, dict[str, str], bytes]:
    """One request on a pooled keep-alive connection: (status, header fields in lower case, body)."""
    conn = await pool.acquire()
    reader, writer = conn
    extra = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
    head = (f"POST {target.path} HTTP/1.1\r\nHost: {pool.host}\r\nContent-Type: {target.content_type}\r\n"
            f"Content-Length: {len(target.body)}\r\n{extra}\r\n").encode()
    reusable = False
    try:
        writer.write(head + target.body)
        raw = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout_s)
        lines = raw.decode("latin-1").split("\r\n")
        status = int(lines[0].split(" ", 2)[1])
        fields = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:] if line)}
        body = await asyncio.wait_for(reader.readexactly(int(fields.get("content-length", "0"))), timeout_s)
        reusable = fields.get("connection", "").lower() != "close"
        return status, fields, body
    finally:
        pool.release(conn, reusable)


async def one(pool: Pool, target: Target, headers: dict[str, str], start: float, timeout_s: float) -> Result:
    try:
        status, retry_after = await send(pool, target, headers, timeout_s)
        return Result(target.path, status, time.perf_counter() - start, retry_after)
    except TimeoutError:
        return Result(target.path, 0, time.perf_counter() - start, False, "timeout")
    except (ConnectionError, asyncio.IncompleteReadError, OSError) as exc:
        return Result(target.path, 0, time.perf_counter() - start, False, type(exc).__name__)


def schedule(targets: Sequence[Target], rates: Sequence[float], duration: float) -> list[tuple[float, Target]]:
    """Send times (seconds from the start) of every request: each target at its own fixed rate."""
    events = [(k / rate, target) for target, rate in zip(targets, rates, strict=True)
              for k in range(max(1, int(rate * duration)))]
    return sorted(events, key=lambda event: event[0])


async def open_loop(pool: Pool, targets: Sequence[Target], rates: Sequence[float], duration: float,
                    headers: dict[str, str], timeout_s: float) -> list[Result]:
    """Requests at fixed times, never waiting for answers."""
    begin = time.perf_counter() + 0.05
    tasks = []
    for offset, target in schedule(targets, rates, duration):
        at = begin + offset
        delay = at - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.ensure_future(one(pool, target, headers, at, timeout_s)))
    return list(await asyncio.gather(*tasks))


async def closed_loop(pool: Pool, targets: Sequence[Target], concurrency: int, duration: float,
                      headers: dict[str, str], timeout_s: float, cycle: bool = False) -> list[Result]:
    """`concurrency` workers, each sending its next request when the last one is answered: to
    its own target (worker i to target i mod n), or with `cycle` to each target in turn."""
    stop = time.perf_counter() + duration
    results: list[Result] = []

    async def worker(index: int) -> None:
        turn = index
        while time.perf_counter() < stop:
            target = targets[turn % len(targets)]
            turn += 1 if cycle else 0
            results.append(await one(pool, target, headers, time.perf_counter(), timeout_s))

    await asyncio.gather(*(worker(i) for i in range(concurrency)))
    return results


def percentile(values: Sequence[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def summarise(results: Sequence[Result], duration: float, deadline_s: float | None = None) -> dict[str, object]:
    """Throughput, goodput, latency percentiles by outcome, and the status mix."""
    ok = [r.latency_s for r in results if r.status == 200]
    rejected = [r.latency_s for r in results if r.status == 503]
    in_time = [x for x in ok if deadline_s is None or x <= deadline_s]

    def ms(value: float | None) -> float | None:
        return None if value is None else round(value * 1000, 2)

    return {
        "requests": len(results),
        "statuses": dict(Counter(str(r.status) for r in results)),
        "errors": dict(Counter(r.error for r in results if r.error)),
        "throughput_rps": round(len(ok) / duration, 2),
        "goodput_rps": round(len(in_time) / duration, 2),
        "ok_ms": {f"p{int(q * 100)}": ms(percentile(ok, q)) for q in (0.5, 0.9, 0.99)},
        "rejected_ms": {f"p{int(q * 100)}": ms(percentile(rejected, q)) for q in (0.5, 0.9, 0.99)},
        "rejected_without_retry_after": sum(1 for r in results if r.status == 503 and not r.retry_after),
    }


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", required=True)
    parser.add_argument("--target", action="append", required=True, type=Target.parse)
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--rate", type=float, help="open loop: requests per second, split evenly over the targets")
    mode.add_argument("--rates", help="open loop: comma-separated requests per second, one per target")
    mode.add_argument("--concurrency", type=int, help="closed loop: workers")
    parser.add_argument("--duration", type=float, default=10.0)
    parser.add_argument("--header", action="append", default=[], help="NAME:VALUE")
    parser.add_argument("--timeout", type=float, default=30.0, help="client-side limit per request, seconds")
    parser.add_argument("--deadline", type=float, help="seconds: answers slower than this do not count as goodput")
    parser.add_argument("--per-target", action="store_true", help="also summarise each target")
    parser.add_argument("--cycle", action="store_true",
                        help="closed loop: each worker sends to every target in turn (round robin), not to one")
    return parser.parse_args(argv)


async def run(args: argparse.Namespace) -> dict[str, object]:
    url = urlsplit(args.url)
    pool = Pool(url.hostname or "127.0.0.1", url.port or 80)
    headers = dict(h.split(":", 1) for h in args.header)
    started = time.perf_counter()
    if args.rate or args.rates:
        rates = ([float(r) for r in args.rates.split(",")] if args.rates
                 else [args.rate / len(args.target)] * len(args.target))
        results = await open_loop(pool, args.target, rates, args.duration, headers, args.timeout)
    else:
        results = await closed_loop(pool, args.target, args.concurrency, args.duration, headers, args.timeout,
                                    args.cycle)
    elapsed = max(args.duration, time.perf_counter() - started) if args.concurrency else args.duration
    report: dict[str, object] = {"mode": "closed" if args.concurrency else "open", "rate": args.rate or args.rates,
                                 "concurrency": args.concurrency, "duration_s": args.duration,
                                 "connections_opened": pool.opened, **summarise(results, elapsed, args.deadline)}
    if args.per_target:
        report["targets"] = {t.path: summarise([r for r in results if r.target == t.path], elapsed, args.deadline)
                             for t in args.target}
    return report


def main(argv: Sequence[str] | None = None) -> int:
    args = parse(argv)
    try:
        from uvloop import run as run_loop
    except ImportError:
        run_loop = asyncio.run
    json.dump(run_loop(run(args)), sys.stdout)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
