"""Wire types of nanopipe: every message between its processes, and their encoding."""

from protocol.client_messages import (
    AbortRequest,
    ChatMessage,
    ClientHello,
    ClientWelcome,
    EngineDead,
    GenerateRequest,
    ResultDelta,
    ResultDeltaBatch,
)
from protocol.codec import MAX_FRAME_BYTES, Decoder, ProtocolError, encode
from protocol.control import Ready, Shutdown, StartupFailed
from protocol.endpoints import Endpoints
from protocol.engine_messages import AbortRequests, AddRequest, DetokRequestInfo
from protocol.metrics import RequestMetrics
from protocol.outcomes import ErrorKind, FieldError, FinishReason, RequestError
from protocol.sampling_params import SamplingParams, SamplingParamsError
from protocol.step_messages import (
    OUT_OF_BAND_STEP,
    CachedSequences,
    NewSequence,
    StepPlan,
    StepResult,
    TokenDeltas,
)

__all__ = [
    "MAX_FRAME_BYTES",
    "OUT_OF_BAND_STEP",
    "AbortRequest",
    "AbortRequests",
    "AddRequest",
    "CachedSequences",
    "ChatMessage",
    "ClientHello",
    "ClientWelcome",
    "Decoder",
    "DetokRequestInfo",
    "Endpoints",
    "EngineDead",
    "ErrorKind",
    "FieldError",
    "FinishReason",
    "GenerateRequest",
    "NewSequence",
    "ProtocolError",
    "Ready",
    "RequestError",
    "RequestMetrics",
    "ResultDelta",
    "ResultDeltaBatch",
    "SamplingParams",
    "SamplingParamsError",
    "Shutdown",
    "StartupFailed",
    "StepPlan",
    "StepResult",
    "TokenDeltas",
    "encode",
]
