"""The Open Inference Protocol over gRPC (Triton's `inference.GRPCInferenceService`, what
tritonclient.grpc speaks) and grpc.health.v1, on the same serving façade, queues and batching as
HTTP. Only the command that starts the server imports this package."""
