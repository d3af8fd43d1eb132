"""What Client and AsyncClient report about their connection, read from their ClientCore."""

from __future__ import annotations

from typing import TYPE_CHECKING

from protocol import ClientWelcome

if TYPE_CHECKING:
    from frontend.client.core import ClientCore


class ConnectionInfo:
    """What Client and AsyncClient report about their connection (their `_core`)."""

    _core: ClientCore

    @property
    def client_id(self) -> str:
        return self._core.client_id

    @property
    def welcome(self) -> ClientWelcome | None:
        return self._core.welcome

    @property
    def dead(self) -> bool:
        """True once the pipeline is known to be gone (requests then raise EngineDeadError)."""
        return self._core.dead is not None

    @property
    def dead_reason(self) -> str | None:
        """Why the pipeline is gone, as the engine (or a lost first connection) said."""
        return self._core.dead

    @property
    def lost_reason(self) -> str | None:
        """Why requests fail while the client reconnects after a dropped connection."""
        return self._core.lost
