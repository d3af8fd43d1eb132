"""Frontend actors (tokenizer, detokenizer) and the client library."""

from frontend.async_client import AsyncClient
from frontend.client import Client
from frontend.outputs import (
    ClientClosedError,
    EngineDeadError,
    RequestDelta,
    RequestOutput,
    RequestRejected,
)
from protocol import SamplingParams, SamplingParamsError

__all__ = [
    "LLM",
    "AsyncClient",
    "Client",
    "ClientClosedError",
    "EngineDeadError",
    "RequestDelta",
    "RequestOutput",
    "RequestRejected",
    "SamplingParams",
    "SamplingParamsError",
]


def __getattr__(name: str):
    # The offline API pulls in the launcher; import it only when asked for.
    if name == "LLM":
        from frontend.llm import LLM

        return LLM
    raise AttributeError(f"module 'frontend' has no attribute {name!r}")
