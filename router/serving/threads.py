"""How many threads each kind of work gets, so that they do not fight over the cores.

Three kinds of threads run on the host: the CPU pool (decoding and pre/post-processing, one image
per thread), torch's intra-op threads (one batch spread over them), and one thread per model
instance (which only waits while a batch runs on a GPU). On the CPU device the scheduler runs one
batch at a time (`devices.cpu.max_concurrent_batches`, default 1), so torch's threads are the
only ones a batch uses. OpenCV runs single-threaded inside a pool thread (router.sdk.images sets
that when it first imports OpenCV): the pool is the parallelism. `count_threads` is the pure
decision; `apply_threads` carries it out once, at start, without importing what the fleet's
plugins did not.

Each serving process also sets its cyclic garbage collector once, at start (`settle_collector`).
"""

from __future__ import annotations

import gc
import logging
import os
import sys
from dataclasses import dataclass

__all__ = ["YOUNG_OBJECTS_PER_COLLECTION", "ThreadCounts", "apply_threads", "count_threads", "settle_collector"]

log = logging.getLogger("router.serving.threads")


@dataclass(frozen=True)
class ThreadCounts:
    cores: int
    cpu_workers: int  # the CPU pool
    torch_threads: int  # torch's intra-op threads, shared by every batch on the CPU


def count_threads(cores: int, cpu_workers: int = 0, torch_threads: int = 0) -> ThreadCounts:
    """The settings where given (> 0), else the measured defaults: torch and the pool each get
    every core. With one batch at a time on the CPU the two overlap only while a batch runs and
    the next inputs decode. On 2 cores, pool 1 and pool 2 cost the same CPU time per answer
    (16.2 and 16.3 answers per CPU-second); pool 1 served more in steady load, pool 2 more goodput
    in the cold 5x surge, so the pool keeps every core (docs/host-pipeline.md, "Threads")."""
    cores = max(1, cores)
    return ThreadCounts(cores=cores, cpu_workers=cpu_workers or cores, torch_threads=torch_threads or cores)


def available_cores() -> int:
    """Cores this process may run on (its affinity mask, e.g. a container's cpuset), else all."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def apply_threads(counts: ThreadCounts) -> None:
    """Set torch's thread count where the fleet's plugins use torch (imported by now); log the counts once."""
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.set_num_threads(counts.torch_threads)
    log.info("threads: %d core(s); CPU pool %d, torch intra-op %d", counts.cores, counts.cpu_workers, counts.torch_threads)


#: New container objects (net of those freed) between two collections of the youngest generation.
#: Python's default, 700, is below what the requests in flight hold alive: at 64 in flight a
#: server collected every 30 or so requests, found next to nothing (what a request allocates is
#: freed by reference counting), and spent 3% of its event loop's time on it. Above the requests in
#: flight, a collection comes when cyclic garbage has gathered, and still bounds it.
YOUNG_OBJECTS_PER_COLLECTION = 5000


def settle_collector() -> None:
    """Set the cyclic collector for a serving process: its youngest generation is collected after
    `YOUNG_OBJECTS_PER_COLLECTION` new objects; the older generations keep Python's ratios."""
    _, middle, old = gc.get_threshold()
    gc.set_threshold(YOUNG_OBJECTS_PER_COLLECTION, middle, old)
