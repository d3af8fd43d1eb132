"""Settings both ends of the client link agree on: the client library and the detokenizer.

Kept here rather than in the client so an actor never imports the client library.
"""

from __future__ import annotations

HEARTBEAT_IVL_MS = 1000
"""ZMTP heartbeat interval on client sockets and on the results socket that serves them."""
HEARTBEAT_TIMEOUT_MS = 10_000
"""A peer silent this long counts as gone: a hung or vanished host becomes a dropped
connection (the client fails its requests; the detokenizer drops the route and aborts)."""
