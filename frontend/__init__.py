"""nanopipe's user-facing side: the offline `LLM`, the client library, the OpenAI server,
the frontend actors and the engine front that starts them (see each subpackage)."""

from frontend.client import (
    AsyncClient,
    Client,
    ClientClosedError,
    ConnectionLostError,
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
    "ConnectionLostError",
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
        from frontend.engine.llm import LLM

        return LLM
    raise AttributeError(f"module 'frontend' has no attribute {name!r}")
