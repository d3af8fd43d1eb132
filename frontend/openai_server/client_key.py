"""Whose share of the engine an HTTP request counts against (scheduler_proc.fair_share).

The server relays every caller over one engine connection, so it names each caller in the
request's client key: the `X-Client-Id` header if sent (a gateway that knows its users sets
it), else the body's `user` field (OpenAI's end-user id), else the caller's address. The one
shared API key of `--api-key` names no one, so it plays no part. A name longer than the
engine allows travels as a short digest of itself: callers are told apart, never refused.
"""

from __future__ import annotations

import hashlib

from starlette.requests import Request

from protocol.limits import MAX_CLIENT_KEY_CHARS

CLIENT_ID_HEADER = "x-client-id"


def client_key(request: Request, user: str | None) -> str:
    """The caller's key: header, then `user`, then "peer:ADDRESS" ("" if none is known)."""
    name = request.headers.get(CLIENT_ID_HEADER) or user
    if not name:
        name = f"peer:{request.client.host}" if request.client is not None else ""
    if len(name) > MAX_CLIENT_KEY_CHARS:
        name = "sha:" + hashlib.blake2s(name.encode("utf-8", "surrogatepass"),
                                        digest_size=12).hexdigest()
    return name
