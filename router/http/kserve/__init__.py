"""Open Inference Protocol (KServe V2 REST, Triton's HTTP API) routes and codec."""
