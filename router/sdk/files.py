"""Writing a file so that it appears complete or not at all."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

__all__ = ["partial_file"]


@contextmanager
def partial_file(target: Path) -> Iterator[Path]:
    """Yield a path beside `target` to write (and check) the file at; it is renamed to `target` when
    the block succeeds and removed when it raises, so an interrupted or failed build never leaves a
    file that later counts as done."""
    partial = target.with_name(f".{target.stem}.partial{target.suffix}")
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        yield partial
        os.replace(partial, target)
    finally:
        partial.unlink(missing_ok=True)
