"""The client library: `Client` (blocking), `AsyncClient` (asyncio) and their output types."""

from frontend.client.async_client import AsyncClient
from frontend.client.outputs import (
    ClientClosedError,
    ConnectionLostError,
    EngineDeadError,
    RequestDelta,
    RequestOutput,
    RequestRejected,
)
from frontend.client.sync_client import Client
from protocol.metrics import RequestMetrics

__all__ = [
    "AsyncClient",
    "Client",
    "ClientClosedError",
    "ConnectionLostError",
    "EngineDeadError",
    "RequestDelta",
    "RequestOutput",
    "RequestMetrics",
    "RequestRejected",
]
