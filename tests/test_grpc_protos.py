"""The .proto of the gRPC front: the committed module is what `make protos` makes of it, and its
service, messages and field numbers are those tritonclient.grpc speaks (Triton's own descriptors,
shipped inside tritonclient, are the reference)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from tritonclient.grpc import model_config_pb2, service_pb2

from router.grpc.protos import grpc_service_pb2 as ours

REPO = Path(__file__).resolve().parents[1]
OURS = ours.DESCRIPTOR
TRITON = {**service_pb2.DESCRIPTOR.message_types_by_name, **model_config_pb2.DESCRIPTOR.message_types_by_name}


def test_the_committed_module_matches_the_proto() -> None:
    done = subprocess.run([sys.executable, "scripts/generate_protos.py", "--check"], cwd=REPO, capture_output=True,
                          text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_service_is_tritons() -> None:
    mine, theirs = OURS.services_by_name["GRPCInferenceService"], service_pb2.DESCRIPTOR.services_by_name["GRPCInferenceService"]
    assert mine.full_name == theirs.full_name == "inference.GRPCInferenceService"
    shape = [(m.name, m.input_type.name, m.output_type.name, m.client_streaming, m.server_streaming) for m in theirs.methods]
    assert [(m.name, m.input_type.name, m.output_type.name, m.client_streaming, m.server_streaming)
            for m in mine.methods] == shape


def fields(message: Any) -> dict[int, tuple[str, int, bool, str]]:
    """Each field by number: name, wire type, repeated, and the name of its message or enum type."""
    kinds = {}
    for field in message.fields:
        related = field.message_type or field.enum_type
        kinds[field.number] = (field.name, field.type, field.is_repeated, related.name if related else "")
    return kinds


def all_messages(descriptor: Any) -> list[Any]:
    found = []
    for message in descriptor.message_types_by_name.values():
        found.append(message)
        found.extend(message.nested_types)
    return found


@pytest.mark.parametrize("message", all_messages(OURS), ids=lambda m: m.full_name)
def test_every_field_has_tritons_number_and_type(message: Any) -> None:
    """Every message is Triton's; ModelConfig and its parts declare a subset of Triton's fields."""
    top = message.containing_type.name if message.containing_type else message.name
    theirs = TRITON[top] if not message.containing_type else TRITON[top].nested_types_by_name[message.name]
    mine, reference = fields(message), fields(theirs)
    if message.file.name == "grpc_service.proto" and top not in ("ModelConfig", "ModelInput", "ModelOutput",
                                                                  "ModelDynamicBatching", "ModelInstanceGroup"):
        assert mine == reference
    else:
        assert mine and {number: reference[number] for number in mine} == mine


def test_the_data_types_are_tritons() -> None:
    assert [(v.name, v.number) for v in OURS.enum_types_by_name["DataType"].values] == [
        (v.name, v.number) for v in model_config_pb2.DataType.DESCRIPTOR.values]


def test_the_module_lives_in_a_pool_of_its_own() -> None:
    """Beside tritonclient's registration of the same names, in one process (this one)."""
    request = ours.ModelInferRequest(model_name="m", id="7")
    assert service_pb2.ModelInferRequest.FromString(request.SerializeToString()).id == "7"
    assert OURS.pool is not service_pb2.DESCRIPTOR.pool
