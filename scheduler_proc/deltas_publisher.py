"""The scheduler's `deltas_pub` socket: a best-effort copy of every step's TokenDeltas for
detokenizers that attach to a running pipeline.

It is an XPUB, so the publisher sees each subscription arrive and answers it at once with a
WatchHeartbeat (plus a WatchRequest for every request still running): a watcher knows the
moment from which it misses nothing. Heartbeats follow every HEARTBEAT_INTERVAL_S, and a
WatchGoodbye ends the stream, so a watcher also knows when the pipeline is gone.

Given a `stats` source, it also publishes the engine's counters (EngineStats) every
STATS_INTERVAL_S, with each heartbeat and greeting, and once more before the goodbye: this
thread reads them, so the step loop pays nothing per step for being watched. When a step
finishes requests the loop raises a flag (`stats_due`), and the stats go out at once, at most
one such message per FRESH_STATS_GAP_S: the data-parallel router counts a request as work
until its replica's stats say it finished, and a burst that follows finished requests must not
be placed on half a second old figures.

A thread of its own owns the XPUB: the step loop hands it frames through an inproc PUSH
(`sink`) and never waits on a watcher.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable

import zmq

from protocol import TokenDeltas, encode
from protocol.auth import CurveKeys
from protocol.engine_messages import EngineStats, WatchGoodbye, WatchHeartbeat, WatchRequest
from protocol.sockets import MessageSocket

log = logging.getLogger("nanopipe.scheduler")

HEARTBEAT_INTERVAL_S = 1.0
STATS_INTERVAL_S = 0.5
FRESH_STATS_GAP_S = 0.025
"""The least time between two stats messages published because requests finished. A busy
engine that finishes requests every step then sends at most 40 a second (a snapshot and one
decode in each subscriber: well under a millisecond of CPU each), while a finish that follows
a quiet spell still goes out at once; one inside the gap waits for its end, never longer."""
PUB_HIGH_WATER_MARK = 10_000
GOODBYE_LINGER_MS = 1000
"""How long closing waits for the goodbye to reach the watchers."""
_WAKE = b""  # an empty frame is never a message: it tells the thread to say goodbye and stop
_ids = itertools.count()


class DeltasPublisher:
    def __init__(self, ctx: zmq.Context, address: str,
                 interval_s: float | None = None,
                 security: CurveKeys | None = None,
                 stats: Callable[[], EngineStats] | None = None,
                 stats_interval_s: float | None = None) -> None:
        # The module's intervals are read here, not at import: a test may lengthen them.
        self.interval_s = HEARTBEAT_INTERVAL_S if interval_s is None else interval_s
        self._stats = stats
        """Called on this object's thread; it must be safe to call from there."""
        self.stats_interval_s = STATS_INTERVAL_S if stats_interval_s is None else stats_interval_s
        self.stats_due = False
        """Set by the step loop before it sends the deltas of finished requests (whose frame
        wakes this thread); cleared by this thread before it reads the counters."""
        self.dead_reason: str | None = None
        """Set by the step loop once the engine is dead; heartbeats carry it."""
        # Internal like every link of the scheduler: over tcp only the run's key holders attach.
        self._xpub = MessageSocket(ctx, zmq.XPUB, address, bind=True, security=security)
        # A slow watcher loses deltas rather than growing this process's memory without bound.
        self._xpub.socket.setsockopt(zmq.SNDHWM, PUB_HIGH_WATER_MARK)
        # Pass every subscription up, not only the first for a topic: each watcher is greeted.
        self._xpub.socket.setsockopt(zmq.XPUB_VERBOSE, 1)
        inproc = f"inproc://deltas-publisher-{next(_ids)}"
        self._frames = MessageSocket(ctx, zmq.PULL, inproc, bind=True)
        self.sink = MessageSocket(ctx, zmq.PUSH, inproc, bind=False)
        """Where the step loop sends encoded frames to publish (its only user)."""
        self._lock = threading.Lock()
        self._running: dict[int, WatchRequest] = {}  # by request id
        self._goodbye: WatchGoodbye | None = None
        self._thread = threading.Thread(target=self._run, name="scheduler-publisher",
                                        daemon=True)
        self._thread.start()

    # ------------------------------------------------------------ step loop side

    def announce(self, request: WatchRequest) -> WatchRequest:
        """Remember a new request; returns the message to publish ahead of its deltas."""
        with self._lock:
            self._running[request.request_id] = request
        return request

    def note_finishes(self, deltas: TokenDeltas) -> bool:
        """Whether `deltas` finish a request; if so, fresh stats are due. Call before sending
        them: their frame wakes this thread, which must find the flag already raised (the
        counters are counted before the deltas exist)."""
        if deltas.finish_reasons.count(None) == len(deltas.finish_reasons):
            return False
        if self._stats is not None:
            self.stats_due = True
        return True

    def forget_finished(self, deltas: TokenDeltas) -> None:
        """Drop finished requests from the greeting. Call after sending their deltas, so a
        watcher greeted in between still learns their names."""
        with self._lock:
            for request_id, finish in zip(deltas.request_ids, deltas.finish_reasons):
                if finish is not None:
                    self._running.pop(request_id, None)

    def close(self, reason: str, engine_dead: bool) -> None:
        """Publish the goodbye and stop. Call once the step loop, the sink's user, is done."""
        if self._goodbye is not None:
            return
        self._goodbye = WatchGoodbye(reason, engine_dead)
        try:
            self.sink.send_bytes(_WAKE)
        except zmq.ZMQError:
            pass
        self._thread.join(timeout=2.0)
        self.sink.close()
        self._frames.close()
        self._xpub.socket.close(linger=GOODBYE_LINGER_MS)

    # ------------------------------------------------------------ publisher thread

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._frames.socket, zmq.POLLIN)
        poller.register(self._xpub.socket, zmq.POLLIN)
        start = time.monotonic()
        next_beat = start + self.interval_s
        next_stats = float("inf") if self._stats is None else start + self.stats_interval_s
        last_fresh = start - FRESH_STATS_GAP_S
        while True:
            due = next_stats
            if self.stats_due:
                due = min(due, last_fresh + FRESH_STATS_GAP_S)
            timeout_ms = max(0.0, min(next_beat, due) - time.monotonic()) * 1000
            ready = dict(poller.poll(timeout_ms))
            if self._frames.socket in ready and not self._forward():
                if self._goodbye is not None:
                    self._publish_stats()  # the final counts
                    self._publish(encode(self._goodbye))
                return
            if self._xpub.socket in ready and self._new_subscriber():
                self._greet()
            now = time.monotonic()
            if now >= next_beat:
                self._publish(self._heartbeat())
                next_beat = now + self.interval_s
                next_stats = now  # stats go with each heartbeat
            if self.stats_due and now >= last_fresh + FRESH_STATS_GAP_S:
                last_fresh = next_stats = now  # the periodic clock starts again from these
            if now >= next_stats:
                self.stats_due = False  # before the read: a finish counted after it raises it
                self._publish_stats()
                next_stats = now + self.stats_interval_s

    def _forward(self) -> bool:
        """Publish every queued frame; False once the wake-up frame says to stop."""
        while True:
            try:
                frame = self._frames.socket.recv(zmq.NOBLOCK)
            except zmq.Again:
                return True
            if frame == _WAKE:
                return False
            self._publish(frame)

    def _new_subscriber(self) -> bool:
        joined = False
        while True:
            try:
                event = self._xpub.socket.recv(zmq.NOBLOCK)
            except zmq.Again:
                return joined
            joined = joined or event[:1] == b"\x01"  # \x01 subscribe, \x00 unsubscribe

    def _greet(self) -> None:
        # Every watcher gets this; those attached already ignore the repeated names.
        self._publish(self._heartbeat())
        with self._lock:
            running = list(self._running.values())
        for request in running:
            self._publish(encode(request))
        self._publish_stats()  # a new follower of the counters gets its baseline at once

    def _heartbeat(self) -> bytes:
        return encode(WatchHeartbeat(self.interval_s, self.dead_reason))

    def _publish_stats(self) -> None:
        if self._stats is not None:
            self._publish(encode(self._stats()))

    def _publish(self, frame: bytes) -> None:
        try:
            self._xpub.socket.send(frame, zmq.NOBLOCK, copy=False)
        except zmq.ZMQError as exc:
            log.warning("scheduler: could not publish to watchers: %s", exc)
