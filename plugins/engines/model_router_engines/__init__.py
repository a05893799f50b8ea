"""What both engine plugins (`onnx`, `tensorrt`) share, and neither owns: the export metadata an
engine carries, the processing chosen by its task, and the checks an export passes before it is
written. Importing it needs neither onnx, onnxruntime nor TensorRT."""

from model_router_engines.checks import CHECK_BATCH, OnnxReference, check_inputs, check_outputs, check_sizes
from model_router_engines.metadata import (
    METADATA_KEY,
    BatchProfile,
    ExportMetadata,
    MetadataError,
    parse_metadata,
    read_sidecar,
    sidecar_path,
    write_sidecar,
)
from model_router_engines.parity import FP16, FP32, ParityReport, Tolerance, compare
from model_router_engines.tasks import ProcessingHooks, ServingOverrides, TaskProcessing, build_processing, staged_input_bytes

__all__ = [
    "CHECK_BATCH",
    "FP16",
    "FP32",
    "METADATA_KEY",
    "BatchProfile",
    "ExportMetadata",
    "MetadataError",
    "OnnxReference",
    "ParityReport",
    "ProcessingHooks",
    "ServingOverrides",
    "TaskProcessing",
    "Tolerance",
    "build_processing",
    "check_inputs",
    "check_outputs",
    "check_sizes",
    "compare",
    "parse_metadata",
    "read_sidecar",
    "sidecar_path",
    "staged_input_bytes",
    "write_sidecar",
]
