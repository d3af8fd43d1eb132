"""Worker threads that decode, check and tokenize requests off the tokenizer's I/O loop.

Tokenizing costs time in proportion to the text; done on the I/O loop, one long prompt held
every other client's request (and every abort) for as long as it took. Here the I/O loop only
queues a job and later collects it. Threads suffice: Hugging Face fast tokenizers tokenize
with the GIL released. Each thread gets its own handler (and tokenizer copy), since a fast
tokenizer's settings are not safe to share between threads.

Which job runs next:
- small jobs before large ones, and large ones never on every thread at once, so a short
  request waits for no long one, whoever sent it;
- within a size class, clients take turns (round robin), so a client that queues many jobs
  delays another client's job by at most one job of each.
A job may be cancelled: dropped if still queued, or flagged if running (the I/O loop then
discards its result). Finished jobs come back through `drain`; `fileno` becomes readable
when there are some, so the I/O loop can poll it with its sockets.

Jobs come back in the order their client sent them (within a size class): a job finished
by one thread waits for the same client's earlier jobs still on another. Otherwise a thread
slowed for a moment (its first call, a lost time slice) sends the client's first request
to the scheduler behind all its later ones, and the scheduler, first come first served
within a client, runs them first.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

LARGE_JOB_BYTES = 64 * 1024
"""A request frame above this size is a large job (tokenizing it takes milliseconds or more)."""


@dataclass(eq=False)
class TokenizeJob:
    peer: bytes
    """Routing id of the client connection that sent it."""
    client_request_id: str
    frame: Any
    """The encoded GenerateRequest (bytes or a buffer kept alive by the job)."""
    size: int
    arrival_time: float = 0.0
    """Wall clock when the frame arrived: the request's arrival in its metrics."""
    cancelled: bool = False
    result: Any = None
    """Set by the handler: what the I/O loop needs to forward the request, or an error."""
    _running: bool = field(default=False, repr=False)
    _finished: bool = field(default=False, repr=False)

    @property
    def large(self) -> bool:
        return self.size > LARGE_JOB_BYTES


class _FairQueue:
    """Jobs per client, served in turns; FIFO within one client."""

    def __init__(self) -> None:
        self.by_peer: OrderedDict[bytes, deque[TokenizeJob]] = OrderedDict()

    def __bool__(self) -> bool:
        return bool(self.by_peer)

    def push(self, job: TokenizeJob) -> None:
        self.by_peer.setdefault(job.peer, deque()).append(job)

    def pop(self) -> TokenizeJob:
        peer, jobs = next(iter(self.by_peer.items()))
        job = jobs.popleft()
        del self.by_peer[peer]
        if jobs:
            self.by_peer[peer] = jobs  # back of the line
        return job

    def remove(self, job: TokenizeJob) -> bool:
        jobs = self.by_peer.get(job.peer)
        if jobs is None or job not in jobs:
            return False
        jobs.remove(job)
        if not jobs:
            del self.by_peer[job.peer]
        return True


class TokenizePool:
    def __init__(self, handlers: list[Callable[[TokenizeJob], None]]) -> None:
        if len(handlers) < 2:
            raise ValueError("the pool needs at least two threads (one is kept for small jobs)")
        self.max_large_running = len(handlers) - 1
        self._lock = threading.Condition()
        self._small = _FairQueue()
        self._large = _FairQueue()
        self._large_running = 0
        self._done: deque[TokenizeJob] = deque()
        self._sent: dict[tuple[bytes, bool], deque[TokenizeJob]] = {}
        """Each client's unreturned jobs per size class, in the order it sent them."""
        self._bytes_by_peer: dict[bytes, int] = {}
        self._stopping = False
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._threads = [threading.Thread(target=self._work, args=(h,), daemon=True,
                                          name=f"tokenize-{i}") for i, h in enumerate(handlers)]
        for t in self._threads:
            t.start()

    # ------------------------------------------------------------ I/O loop side

    def fileno(self) -> int:
        return self._wake_r

    def pending_bytes(self, peer: bytes) -> int:
        """Frame bytes of this client's jobs that are queued or running."""
        with self._lock:
            return self._bytes_by_peer.get(peer, 0)

    def submit(self, job: TokenizeJob) -> None:
        with self._lock:
            self._bytes_by_peer[job.peer] = self._bytes_by_peer.get(job.peer, 0) + job.size
            (self._large if job.large else self._small).push(job)
            self._sent.setdefault((job.peer, job.large), deque()).append(job)
            self._lock.notify_all()

    def cancel(self, job: TokenizeJob) -> bool:
        """True if the job was still queued (it is dropped); else it is flagged cancelled."""
        with self._lock:
            job.cancelled = True
            if job._running or not (self._large if job.large else self._small).remove(job):
                return False
            self._release(job)
            # Still queued, so no later job of its client has run: none waits on it.
            key = (job.peer, job.large)
            self._sent[key].remove(job)
            if not self._sent[key]:
                del self._sent[key]
            return True

    def drain(self) -> list[TokenizeJob]:
        try:
            while os.read(self._wake_r, 4096):
                pass
        except BlockingIOError:
            pass
        with self._lock:
            done = list(self._done)
            self._done.clear()
        return done

    def close(self) -> None:
        with self._lock:
            self._stopping = True
            self._lock.notify_all()
        for t in self._threads:
            t.join(timeout=5)
        os.close(self._wake_r)
        os.close(self._wake_w)

    # ------------------------------------------------------------ worker side

    def _work(self, handler: Callable[[TokenizeJob], None]) -> None:
        while True:
            job = self._next_job()
            if job is None:
                return
            try:
                handler(job)
            except BaseException as exc:  # a handler bug must still answer the request
                job.result = exc
            with self._lock:
                job._running = False
                if job.large:
                    self._large_running -= 1
                    self._lock.notify_all()
                self._release(job)
                job._finished = True
                returned = self._return_in_order(job.peer, job.large)
            if returned:
                self._wake()

    def _wake(self) -> None:
        """Make `fileno` readable: there are jobs to drain."""
        try:
            os.write(self._wake_w, b"\0")
        except OSError:
            pass  # the pipe is full (the I/O loop will wake anyway) or closed

    def _next_job(self) -> TokenizeJob | None:
        with self._lock:
            while not self._stopping:
                if self._small:
                    job = self._small.pop()
                elif self._large and self._large_running < self.max_large_running:
                    job = self._large.pop()
                    self._large_running += 1
                else:
                    self._lock.wait()
                    continue
                job._running = True
                return job
            return None

    def _return_in_order(self, peer: bytes, large: bool) -> bool:
        """Move the client's finished jobs that no earlier job of theirs waits on to the
        done list (under the lock); whether any moved."""
        key = (peer, large)
        sent = self._sent[key]
        moved = False
        while sent and sent[0]._finished:
            self._done.append(sent.popleft())
            moved = True
        if not sent:
            del self._sent[key]
        return moved

    def _release(self, job: TokenizeJob) -> None:
        left = self._bytes_by_peer[job.peer] - job.size
        if left:
            self._bytes_by_peer[job.peer] = left
        else:
            del self._bytes_by_peer[job.peer]
