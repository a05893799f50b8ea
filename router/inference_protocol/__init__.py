"""The Open Inference Protocol (KServe V2, Triton's API) without its wire formats: tensors, requests,
the payloads a model takes and the answers it gives, repository answers, shared memory. The HTTP
front (`router.http.kserve`) and the gRPC front (`router.grpc`) decode into these and encode from
them, so the two cannot drift apart."""
