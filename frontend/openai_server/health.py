"""What /health says: one of these states, with the reason for anything but ready.

    starting (503): the engine is not ready yet (reason: what start-up is doing)
    ready    (200): requests are served
    degraded (200): requests are served, but some data-parallel replicas are down (reason:
                    which, and why); a load balancer keeps sending, an operator is told
    unavailable (503): the engine runs but takes no new request: every prefill replica is
                    down (disaggregation); the decode replicas finish the requests they hold
    reconnecting (503): the connection to the engine dropped (it stalled past the heartbeat
                    timeout); the server reconnects by itself and is ready again once it answers
    dead     (503): the engine is gone (reason: what the engine said)
    shutting_down (503): the server was told to stop (SIGTERM, Ctrl-C) and is draining

Load balancers and orchestrators read the status code; people read the JSON body
`{"status": ..., "reason": ...}`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Protocol

from protocol import ClientWelcome


class HealthStatus(enum.Enum):
    STARTING = "starting"
    READY = "ready"
    DEGRADED = "degraded"
    UNAVAILABLE = "unavailable"
    RECONNECTING = "reconnecting"
    DEAD = "dead"
    SHUTTING_DOWN = "shutting_down"


class NoNewRequests(str):
    """A reason for lost replicas under which no new request can be served (every prefill
    replica is down): /health is then `unavailable`, so a load balancer sends no more."""


@dataclass(frozen=True, slots=True)
class Health:
    status: HealthStatus
    reason: str | None = None

    @property
    def http_status(self) -> int:
        return 200 if self.status in (HealthStatus.READY, HealthStatus.DEGRADED) else 503

    def body(self) -> dict[str, Any]:
        return {"status": self.status.value, "reason": self.reason}


class Connection(Protocol):
    """What /health reads of the server's client of the pipeline."""

    @property
    def welcome(self) -> ClientWelcome | None: ...

    @property
    def dead_reason(self) -> str | None: ...

    @property
    def lost_reason(self) -> str | None: ...


def health_of(client: Connection, degraded: str | None = None,
              stopping: bool = False) -> Health:
    """The state of the pipeline behind `client`; `degraded` is the launcher's word on lost
    replicas (Pipeline.degraded), None when all serve or the server runs apart from it;
    `stopping`: the server was told to stop, so a load balancer must send no more."""
    if client.dead_reason is not None:
        return Health(HealthStatus.DEAD, client.dead_reason)
    if stopping:
        return Health(HealthStatus.SHUTTING_DOWN, "the server is shutting down")
    if client.lost_reason is not None:
        return Health(HealthStatus.RECONNECTING, client.lost_reason)
    if client.welcome is None:
        return Health(HealthStatus.STARTING, "connecting to the engine")
    if degraded is not None:
        unavailable = isinstance(degraded, NoNewRequests)
        return Health(HealthStatus.UNAVAILABLE if unavailable else HealthStatus.DEGRADED,
                      str(degraded))
    return Health(HealthStatus.READY)
