"""The tokenizer's record of client requests, so an abort finds what it names.

A client names a request by (its connection, client_request_id); the pipeline by an int
request id the tokenizer assigns. While a request is still being tokenized the abort must
reach its pool job instead, so the book holds both stages.
"""

from __future__ import annotations

from collections import OrderedDict

from frontend.actors.tokenize_pool import TokenizeJob

MAX_TRACKED_REQUESTS = 1 << 18
"""Request ids remembered for aborts. The tokenizer never learns when a request ends, so
the oldest are forgotten first; aborting a long-finished request is a no-op anyway."""

Key = tuple[bytes, str]
"""(peer routing id, client_request_id)."""


class RequestBook:
    def __init__(self, max_tracked: int = MAX_TRACKED_REQUESTS) -> None:
        self.max_tracked = max_tracked
        self._request_ids: OrderedDict[Key, int] = OrderedDict()
        self._preparing: dict[Key, TokenizeJob] = {}
        """Jobs queued or running in the pool, by (peer, client_request_id), for aborts."""
        self._next_request_id = 0

    def preparing(self, job: TokenizeJob) -> None:
        """A job handed to the pool; one without a readable id cannot be aborted."""
        if job.client_request_id:
            self._preparing[(job.peer, job.client_request_id)] = job

    def prepared(self, job: TokenizeJob) -> None:
        """The pool is done with `job` (a later request may reuse its key: keep that one)."""
        key = (job.peer, job.client_request_id)
        if self._preparing.get(key) is job:
            del self._preparing[key]

    def assign(self, peer: bytes, client_request_id: str) -> int:
        """A new pipeline request id for a request about to be forwarded, remembered."""
        request_id = self._next_request_id
        self._next_request_id += 1
        key = (peer, client_request_id)
        self._request_ids[key] = request_id
        self._request_ids.move_to_end(key)
        if len(self._request_ids) > self.max_tracked:
            self._request_ids.popitem(last=False)
        return request_id

    def take_preparing(self, peer: bytes, client_request_id: str) -> TokenizeJob | None:
        return self._preparing.pop((peer, client_request_id), None)

    def take_request_id(self, peer: bytes, client_request_id: str) -> int | None:
        return self._request_ids.pop((peer, client_request_id), None)
