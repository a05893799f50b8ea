"""Scale-out on Ray Serve: one router replica per device, placed, restarted and scaled by Ray.

- `replica`: a Serve deployment whose every replica runs the router's `Runtime` for one device.
- `controller`: the placement deployment: collects the replicas' reports, plans model copies.
- `ray_router`: Ray's request router, ranking replicas by where a model is resident.
- `front`: `ClusterRuntime`, the core of the front's `Serving` over the replicas, and the HTTP front replica.
- `app` and `commands`: the Serve application from a fleet file; deploy, status, shutdown.

Only this package imports `ray` (an import-linter contract says so); `reports`, `routing` and
`placement` are pure and import nothing of Ray.
"""
