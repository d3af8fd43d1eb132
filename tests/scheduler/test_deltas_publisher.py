"""The scheduler's deltas_pub socket greets each subscriber at once, names the running
requests, beats while idle, forwards deltas in order and says goodbye when it closes."""

from __future__ import annotations

import time

import zmq

from protocol import Decoder, FinishReason, TokenDeltas
from protocol.engine_messages import WatchGoodbye, WatchHeartbeat, WatchRequest
from scheduler_proc.deltas_publisher import DeltasPublisher

DECODER = Decoder(TokenDeltas, WatchHeartbeat, WatchRequest, WatchGoodbye)


def subscribe(ctx: zmq.Context, address: str) -> zmq.Socket:
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(address)
    return sub


def receive(sub: zmq.Socket, timeout_s: float = 5.0):
    assert sub.poll(int(timeout_s * 1000)), "nothing published"
    return DECODER.decode(sub.recv())


def finished(request_id: int) -> TokenDeltas:
    return TokenDeltas(1, [request_id], [[5]], [FinishReason.STOP], [None], None)


def test_each_subscriber_is_greeted_at_once_with_the_running_requests(wiring):
    ctx, address = wiring
    pub = DeltasPublisher(ctx, address, interval_s=60.0)  # no periodic beat during the test
    try:
        pub.announce(WatchRequest(1, "first"))
        pub.announce(WatchRequest(2, "second", ["stop"]))
        pub.forget_finished(finished(1))
        started = time.monotonic()
        early = subscribe(ctx, address)
        assert receive(early) == WatchHeartbeat(60.0, None)
        assert time.monotonic() - started < 2.0
        assert receive(early) == WatchRequest(2, "second", ["stop"])  # with its stop strings
        late = subscribe(ctx, address)  # the same topic again: greeted too (XPUB_VERBOSE)
        assert receive(late) == WatchHeartbeat(60.0, None)
        # From the greeting on, nothing is missed, in order.
        pub.sink.send(pub.announce(WatchRequest(3, "third")))
        pub.sink.send(finished(3))
        for sub in (early, late):
            # A greeting racing the announcement may name request 3 twice; watchers ignore
            # repeated names. What matters: the name arrives before the request's deltas.
            seen = []
            while not isinstance(msg := receive(sub), TokenDeltas):
                assert isinstance(msg, WatchHeartbeat | WatchRequest)
                seen.append(msg)
            assert WatchRequest(3, "third") in seen
            assert msg == finished(3)
        pub.close("the pipeline stopped (SIGTERM)", engine_dead=False)
        for sub in (early, late):
            assert receive(sub) == WatchGoodbye("the pipeline stopped (SIGTERM)", False)
            sub.close(0)
    finally:
        pub.close("test over", engine_dead=False)


def test_heartbeats_keep_coming_and_carry_the_engine_death(wiring):
    ctx, address = wiring
    pub = DeltasPublisher(ctx, address, interval_s=0.2)
    sub = subscribe(ctx, address)
    try:
        assert receive(sub) == WatchHeartbeat(0.2, None)
        started = time.monotonic()
        assert receive(sub) == WatchHeartbeat(0.2, None)
        assert receive(sub) == WatchHeartbeat(0.2, None)
        assert time.monotonic() - started < 2.0
        pub.dead_reason = "worker 0 exited with code -9"
        while (msg := receive(sub)).dead_reason is None:
            pass
        assert msg == WatchHeartbeat(0.2, "worker 0 exited with code -9")
    finally:
        sub.close(0)
        pub.close("test over", engine_dead=False)
