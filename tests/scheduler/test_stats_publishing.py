"""The deltas publisher sends the engine's counters on its own clock: at each greeting, every
stats interval whatever the steps do, and once more before the goodbye; a subscriber of the
stats topic gets nothing else."""

from __future__ import annotations

import time

import zmq

from protocol import Decoder, FinishReason, TokenDeltas
from protocol.engine_messages import (
    ENGINE_STATS_TOPIC,
    EngineStats,
    WatchGoodbye,
    WatchHeartbeat,
    WatchRequest,
)
from scheduler_proc.deltas_publisher import DeltasPublisher

ALL = Decoder(TokenDeltas, WatchHeartbeat, WatchRequest, WatchGoodbye, EngineStats)


class Counter:
    """A stats source whose generated-token count is how often it was read."""

    def __init__(self) -> None:
        self.reads = 0

    def __call__(self) -> EngineStats:
        self.reads += 1
        return EngineStats(time.monotonic(), 0, 0, 0, self.reads, 0, 0, 0.0, 0.0, 0, 0, 0, 8)


def subscribe(ctx: zmq.Context, address: str, topic: bytes = b"") -> zmq.Socket:
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, topic)
    sub.connect(address)
    return sub


def receive(sub: zmq.Socket, timeout_s: float = 5.0):
    assert sub.poll(int(timeout_s * 1000)), "nothing published"
    return ALL.decode(sub.recv())


def test_stats_come_at_the_greeting_every_interval_and_before_the_goodbye(wiring):
    ctx, address = wiring
    source = Counter()
    pub = DeltasPublisher(ctx, address, interval_s=60.0, stats=source, stats_interval_s=0.1)
    watcher = subscribe(ctx, address)
    stats_only = subscribe(ctx, address, ENGINE_STATS_TOPIC)
    try:
        assert isinstance(receive(watcher), WatchHeartbeat)
        assert isinstance(receive(watcher), EngineStats)  # the greeting's baseline
        started = time.monotonic()
        seen = [receive(stats_only) for _ in range(5)]
        assert all(isinstance(m, EngineStats) for m in seen)
        assert time.monotonic() - started < 2.0  # on the stats clock, not the heartbeat's
        counts = [m.generated_tokens for m in seen]
        assert counts == sorted(counts) and len(set(counts)) == 5
        # Deltas and names are not sent to a stats-only subscriber.
        pub.sink.send(pub.announce(WatchRequest(1, "r")))
        pub.sink.send(TokenDeltas(0, [1], [[5]], [FinishReason.STOP], [None], None))
        pub.close("stopping", engine_dead=False)
        last = None
        while stats_only.poll(500):
            last = ALL.decode(stats_only.recv())
            assert isinstance(last, EngineStats)
        assert last is not None and last.generated_tokens == source.reads
        rest = []
        while watcher.poll(500):
            rest.append(ALL.decode(watcher.recv()))
        assert TokenDeltas(0, [1], [[5]], [FinishReason.STOP], [None], None) in rest
        assert rest[-1] == WatchGoodbye("stopping", False)
        assert isinstance(rest[-2], EngineStats)
    finally:
        watcher.close(0)
        stats_only.close(0)
        pub.close("test over", engine_dead=False)


def test_without_a_stats_source_nothing_but_the_watch_messages(wiring):
    ctx, address = wiring
    pub = DeltasPublisher(ctx, address, interval_s=0.1)
    sub = subscribe(ctx, address)
    try:
        for _ in range(4):
            assert isinstance(receive(sub), WatchHeartbeat)
    finally:
        sub.close(0)
        pub.close("test over", engine_dead=False)
