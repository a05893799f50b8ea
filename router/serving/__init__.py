"""Serving: `Serving` over a core (`facade`), the in-process core (`runtime`), the fleet calls
(`verbs`), deployments, instances and their lifecycle, loading and warm-up, memory profiling,
plugin discovery and fleet resolution."""
