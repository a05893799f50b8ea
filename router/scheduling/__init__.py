"""Scheduling: per-model queues, batch admission, the deadline gate, the memory ledger and probes, service-time
estimates, and the device scheduler that dispatches batches. Knows nothing of HTTP or of how
models are loaded; instances reach it through the small protocols in `scheduler`."""
