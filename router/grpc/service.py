"""`inference.GRPCInferenceService`: every RPC of the protocol's service, each a handler of
(message, call) on the serving façade, and the grpc handler table built from the .proto's own
service descriptor (so a method the .proto declares and this class lacks fails at start-up).

Answers come from the same protocol-neutral values as V2 over HTTP (`router.inference_protocol`),
turned into messages with protobuf's JSON mapping.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any, Final

import grpc
from google.protobuf import json_format
from grpc import aio

from router.access import Access, AccessPolicy
from router.errors import InputError, Unimplemented, brief
from router.grpc.calls import SERVICE, SERVICE_NAME, Call, call_of, check_access, hold_stream, run_call
from router.grpc.inference import Inference, shared_memory_caller
from router.grpc.protos import grpc_service_pb2 as pb
from router.grpc.streams import OpenStreams
from router.inference_protocol import repository
from router.inference_protocol.shared_memory import Caller, SharedMemoryRegistry, refuse_cuda
from router.inference_protocol.targets import Pipelines, find_target, is_ready, repository_index
from router.serving.facade import Serving
from router.tracing.api import Tracing

__all__ = ["SERVICE_NAME", "InferenceService"]
#: What each call needs of the client's key; the rest need an inference key, as V2 over HTTP.
ACCESS: Final[Mapping[str, Access]] = {
    "ServerLive": Access.HEALTH, "ServerReady": Access.HEALTH,
    "RepositoryModelLoad": Access.ADMIN, "RepositoryModelUnload": Access.ADMIN,
}


def _message(document: Mapping[str, Any], message: Any) -> Any:
    return json_format.ParseDict(document, message)


class InferenceService:
    """The handlers of the Open Inference Protocol's gRPC service."""

    def __init__(self, runtime: Serving, pipelines: Pipelines, inference: Inference,
                 shared_memory: SharedMemoryRegistry, policy: AccessPolicy, tracing: Tracing | None = None, *,
                 keyless: OpenStreams) -> None:
        self.runtime = runtime
        self.pipelines = pipelines  # served as models, as V2 over HTTP serves them (Triton's ensembles)
        self.inference = inference
        self.shared_memory = shared_memory
        self.policy = policy
        self.tracing = tracing
        self.keyless = keyless  # open streams without an inference key (ModelStreamInfer on a server without keys)

    # -- health and metadata -------------------------------------------------------------------------

    async def ServerLive(self, message: Any, call: Call) -> Any:
        return pb.ServerLiveResponse(live=True)

    async def ServerReady(self, message: Any, call: Call) -> Any:
        return pb.ServerReadyResponse(ready=self.runtime.ready)

    async def ModelReady(self, message: Any, call: Call) -> Any:
        """Ready or not; an unknown model or version is not ready (as tritonclient.http reads a 404)."""
        return pb.ModelReadyResponse(ready=is_ready(self.runtime, self.pipelines, message.name, message.version))

    async def ServerMetadata(self, message: Any, call: Call) -> Any:
        return _message(repository.server_metadata(), pb.ServerMetadataResponse())

    async def ModelMetadata(self, message: Any, call: Call) -> Any:
        target = find_target(self.runtime, self.pipelines, message.name, message.version)
        return _message(target.metadata(), pb.ModelMetadataResponse())

    async def ModelConfig(self, message: Any, call: Call) -> Any:
        model = self.runtime.model(message.name)
        repository.check_version(message.name, message.version)
        return pb.ModelConfigResponse(config=_message(repository.model_config(model), pb.ModelConfig()))

    async def ModelStatistics(self, message: Any, call: Call) -> Any:
        models = self.runtime.models() if not message.name else [self.runtime.model(message.name)]
        if message.name:
            repository.check_version(message.name, message.version)
        stats = [repository.model_statistics(model) for model in models]
        return _message({"model_stats": stats}, pb.ModelStatisticsResponse())

    # -- inference -------------------------------------------------------------------------------------

    async def ModelInfer(self, message: Any, call: Call) -> Any:
        return await self.inference.infer(message, call)

    # -- the repository ------------------------------------------------------------------------------

    async def RepositoryIndex(self, message: Any, call: Call) -> Any:
        entries = repository_index(self.runtime, self.pipelines, ready_only=message.ready)
        return pb.RepositoryIndexResponse(models=[pb.RepositoryIndexResponse.ModelIndex(
            name=e.name, version=e.version, state=e.state, reason=e.reason) for e in entries])

    async def RepositoryModelLoad(self, message: Any, call: Call) -> Any:
        _no_parameters(message, "load")
        await self.runtime.load_model(message.model_name)
        return pb.RepositoryModelLoadResponse()

    async def RepositoryModelUnload(self, message: Any, call: Call) -> Any:
        _no_parameters(message, "unload", ignored=("unload_dependents",))  # tritonclient always sends it; no ensembles here
        await self.runtime.unload_model(message.model_name)
        return pb.RepositoryModelUnloadResponse()

    # -- shared memory -------------------------------------------------------------------------------

    async def SystemSharedMemoryStatus(self, message: Any, call: Call) -> Any:
        response = pb.SystemSharedMemoryStatusResponse()
        for region in self.shared_memory.status(self._caller(call), message.name or None):
            response.regions[region.name].CopyFrom(pb.SystemSharedMemoryStatusResponse.RegionStatus(
                name=region.name, key=region.key, offset=region.offset, byte_size=region.byte_size))
        return response

    async def SystemSharedMemoryRegister(self, message: Any, call: Call) -> Any:
        self.shared_memory.register(self._caller(call), message.name, message.key, message.offset, message.byte_size)
        return pb.SystemSharedMemoryRegisterResponse()

    async def SystemSharedMemoryUnregister(self, message: Any, call: Call) -> Any:
        self.shared_memory.unregister(self._caller(call), message.name or None)
        return pb.SystemSharedMemoryUnregisterResponse()

    def _caller(self, call: Call) -> Caller:
        return shared_memory_caller(self.shared_memory, self.policy, call)

    async def CudaSharedMemoryStatus(self, message: Any, call: Call) -> Any:
        if message.name:
            raise refuse_cuda()
        return pb.CudaSharedMemoryStatusResponse()  # none is ever registered

    async def CudaSharedMemoryRegister(self, message: Any, call: Call) -> Any:
        raise refuse_cuda()

    async def CudaSharedMemoryUnregister(self, message: Any, call: Call) -> Any:
        return pb.CudaSharedMemoryUnregisterResponse()  # nothing to unregister

    # -- not served ----------------------------------------------------------------------------------

    async def TraceSetting(self, message: Any, call: Call) -> Any:
        raise Unimplemented("trace settings are not served; the router's logs carry each request's id and timings")

    async def LogSettings(self, message: Any, call: Call) -> Any:
        raise Unimplemented("log settings are not served; set MODEL_ROUTER_LOG_LEVEL")

    # -- the handler table ---------------------------------------------------------------------------

    async def ModelStreamInfer(self, frames: AsyncIterator[Any], context: aio.ServicerContext[Any, Any]) -> AsyncIterator[Any]:
        call = call_of(context, "ModelStreamInfer")
        await check_access(self.policy, Access.PREDICT, call, context)
        counted = await hold_stream(self.keyless, self.policy, call, context)
        try:
            async for response in self.inference.stream(frames, context, call):
                yield response
        finally:
            if counted is not None:
                self.keyless.closed(counted)

    def handler(self) -> grpc.GenericRpcHandler:
        """The grpc handlers of every method the .proto declares."""
        methods = {}
        for method in SERVICE.methods:  # requests arrive as bytes: each handler parses its own (`calls.parse`)
            response = getattr(pb, method.output_type.name)
            if method.client_streaming:
                methods[method.name] = grpc.stream_stream_rpc_method_handler(
                    self.ModelStreamInfer, response_serializer=response.SerializeToString)
                continue
            methods[method.name] = grpc.unary_unary_rpc_method_handler(
                self._unary(method.name, getattr(pb, method.input_type.name)),
                response_serializer=response.SerializeToString)
        return grpc.method_handlers_generic_handler(SERVICE_NAME, methods)

    def _unary(self, name: str, request_type: Any) -> Callable[[bytes, aio.ServicerContext[Any, Any]], Awaitable[Any]]:
        handler = getattr(self, name)  # AttributeError at start-up for a method the class lacks
        access = ACCESS.get(name, Access.PREDICT)

        async def unary(raw: bytes, context: aio.ServicerContext[Any, Any]) -> Any:
            return await run_call(handler, request_type, raw, context, method=name, access=access, policy=self.policy,
                                  tracing=self.tracing)

        return unary


def _no_parameters(message: Any, verb: str, ignored: tuple[str, ...] = ()) -> None:
    """Refuse what a load or unload asks that the fleet file decides (a config override, model files)."""
    given = sorted(key for key in message.parameters if key not in ignored)
    if given:
        raise InputError(f"{verb} parameters are not supported (the fleet file defines each model), got {brief(given, 60)}")
