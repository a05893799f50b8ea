"""The .proto of the service and its generated module (`make protos` regenerates it)."""
