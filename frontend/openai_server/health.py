"""What /health says: one of three states, with the reason for anything but ready.

    starting (503): the engine is not ready yet (reason: what start-up is doing)
    ready    (200): requests are served
    dead     (503): the engine is gone (reason: what the engine said)

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
    DEAD = "dead"


@dataclass(frozen=True, slots=True)
class Health:
    status: HealthStatus
    reason: str | None = None

    @property
    def http_status(self) -> int:
        return 200 if self.status is HealthStatus.READY else 503

    def body(self) -> dict[str, Any]:
        return {"status": self.status.value, "reason": self.reason}


class Connection(Protocol):
    """What /health reads of the server's client of the pipeline."""

    @property
    def welcome(self) -> ClientWelcome | None: ...

    @property
    def dead_reason(self) -> str | None: ...


def health_of(client: Connection) -> Health:
    if client.dead_reason is not None:
        return Health(HealthStatus.DEAD, client.dead_reason)
    if client.welcome is None:
        return Health(HealthStatus.STARTING, "connecting to the engine")
    return Health(HealthStatus.READY)
