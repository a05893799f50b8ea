"""Serving: the runtime (the façade the HTTP layer uses), deployments, instances and their
lifecycle, loading and warm-up, memory profiling, plugin discovery and fleet resolution."""
