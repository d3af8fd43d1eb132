"""Stats follow finished requests at once, not on the periodic clock, and a stream of finishes
is sent at most one stats message per FRESH_STATS_GAP_S: the data-parallel router counts a
request as work until its replica's stats say it finished."""

from __future__ import annotations

import time

import pytest
import zmq
from fake_worker import make_request
from test_sched_loop import Harness, finished

from protocol import Decoder, FinishReason, TokenDeltas
from protocol.engine_messages import ENGINE_STATS_TOPIC, EngineStats
from scheduler_proc import SchedulerConfig, deltas_publisher
from scheduler_proc.deltas_publisher import FRESH_STATS_GAP_S, DeltasPublisher

pytestmark = pytest.mark.timeout(60)
STATS = Decoder(EngineStats)
PROMPTLY_S = 1.0
"""A generous bound for a loaded 2-core machine; the periodic clock is set to a minute."""


def subscribe(ctx: zmq.Context, address: str) -> zmq.Socket:
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, ENGINE_STATS_TOPIC)
    sub.connect(address)
    return sub


def received(sub: zmq.Socket, wait_s: float) -> list[EngineStats]:
    """Every stats message that arrives within `wait_s` of the last one (or of the call)."""
    out = []
    while sub.poll(int(wait_s * 1000)):
        out.append(STATS.decode(sub.recv()))
    return out


def until(sub: zmq.Socket, done, timeout_s: float) -> list[EngineStats]:
    """Stats messages up to and including the first for which `done` holds."""
    deadline = time.monotonic() + timeout_s
    out: list[EngineStats] = []
    while not out or not done(out[-1]):
        left = deadline - time.monotonic()
        assert left > 0 and sub.poll(int(left * 1000)), "no stats in time"
        out.append(STATS.decode(sub.recv()))
    return out


def assert_rate_limited(seen: list[EngineStats]) -> None:
    """n fresh messages span at least (n-1) gaps (less one snapshot's delay)."""
    span = seen[-1].time_s - seen[0].time_s
    assert (len(seen) - 1) * FRESH_STATS_GAP_S <= span + 0.02, [m.time_s for m in seen]


@pytest.fixture
def slow_clocks(monkeypatch):
    monkeypatch.setattr(deltas_publisher, "STATS_INTERVAL_S", 60.0)
    monkeypatch.setattr(deltas_publisher, "HEARTBEAT_INTERVAL_S", 60.0)


def test_the_scheduler_publishes_stats_when_requests_finish(slow_clocks):
    h = Harness(SchedulerConfig(64, 4, max_num_batched_tokens=64, max_model_len=64))
    sub = subscribe(h.ctx, h.ep.deltas_pub)
    try:
        baseline = until(sub, lambda m: True, 5.0)[0]  # the greeting: subscribed from here
        assert baseline.finished_requests == 0
        h.front.send(make_request(1, 6, max_tokens=4, ignore_eos=True))
        h.collect_until(finished([1]))
        done = time.monotonic()
        last = until(sub, lambda m: m.finished_requests == 1, PROMPTLY_S)[-1]
        assert time.monotonic() - done < PROMPTLY_S
        assert (last.running, last.waiting, last.generated_tokens) == (0, 0, 4)
        assert [m.finish_reason for m in last.finished] == [FinishReason.LENGTH]

        # Twelve requests finishing on twelve steps in a row.
        for i in range(12):
            h.front.send(make_request(10 + i, 5, max_tokens=1 + i, ignore_eos=True))
        h.collect_until(finished(range(10, 22)))
        seen = until(sub, lambda m: m.finished_requests == 13, PROMPTLY_S)
        assert sum(len(m.finished) for m in seen) == 12  # each record in one message
        assert_rate_limited(seen)
    finally:
        sub.close(0)
        h.close()


class Reads:
    """A stats source whose finished count is how often it was read."""

    def __init__(self) -> None:
        self.reads = 0

    def __call__(self) -> EngineStats:
        self.reads += 1
        return EngineStats(time.monotonic(), 0, 0, 0, 0, 0, self.reads, 0.0, 0.0, 0, 0, 0, 8)


def test_a_stream_of_finishes_is_coalesced_and_other_steps_send_nothing(wiring):
    ctx, address = wiring
    source = Reads()
    pub = DeltasPublisher(ctx, address, interval_s=60.0, stats=source, stats_interval_s=60.0)
    sub = subscribe(ctx, address)
    try:
        until(sub, lambda m: True, 5.0)  # the greeting's baseline
        going = TokenDeltas(0, [1, 2], [[5], [6]], [None, None], [None, None], None)
        for _ in range(50):
            assert not pub.note_finishes(going)
            pub.sink.send(going)
        assert received(sub, 0.3) == []  # steps that finish nothing publish no stats

        start = time.monotonic()
        for step in range(200):
            ending = TokenDeltas(step, [step], [[5]], [FinishReason.STOP], [None], None)
            assert pub.note_finishes(ending)
            pub.sink.send(ending)
        sent_s = time.monotonic() - start
        seen = received(sub, 0.3)
        assert seen and seen[0].time_s - start < PROMPTLY_S
        assert len(seen) <= 2 + sent_s / FRESH_STATS_GAP_S < 200
        assert_rate_limited(seen)
        assert seen[-1].finished_requests == source.reads  # the last read follows the last
    finally:
        sub.close(0)
        pub.close("test over", engine_dead=False)
