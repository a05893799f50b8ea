"""The HTTP layer: the Litestar app, access control, the server with its drain, logs' request
ids, Prometheus metrics, and the KServe V2 routes. It reads the runtime's snapshots and calls its
verbs; it never touches the runtime's state."""
