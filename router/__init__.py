"""model-router: serve a fleet of vision models behind per-model queues, dynamic batching and a
memory-budget scheduler."""

from __future__ import annotations

__version__ = "0.2.0"

__all__ = ["__version__"]
