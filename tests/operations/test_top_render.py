"""The dashboard's state and frame as pure functions: messages in, text out."""

from __future__ import annotations

import dataclasses

from rich.console import Console

from frontend.top import TopState, render
from frontend.top.render import kv_bar
from protocol import ErrorKind, FinishReason, RequestError, TokenDeltas
from protocol.engine_messages import EngineStats, WatchRequest


def stats(t: float, steps: int = 0, prompt: int = 0, cached: int = 0, generated: int = 0,
          finished: int = 0, schedule: float = 0.0, result: float = 0.0, running: int = 0,
          waiting: int = 0, used: int = 0, total: int = 100, busy: float = 0.0) -> EngineStats:
    return EngineStats(time_s=t, steps=steps, prompt_tokens=prompt, cached_prompt_tokens=cached,
                       generated_tokens=generated, preemptions=1, finished_requests=finished,
                       schedule_time_s=schedule, result_time_s=result, running=running,
                       waiting=waiting, kv_blocks_used=used, kv_blocks_total=total,
                       gpu_busy_s=busy)


def deltas(items: dict[int, list[int]], finish: dict[int, FinishReason] | None = None,
           errors: dict[int, RequestError] | None = None) -> TokenDeltas:
    finish, errors = finish or {}, errors or {}
    ids = list(items)
    return TokenDeltas(step_id=0, request_ids=ids, token_ids=[items[i] for i in ids],
                       finish_reasons=[finish.get(i) for i in ids],
                       errors=[errors.get(i) for i in ids], logprobs=None)


def text(state: TopState, now: float) -> str:
    console = Console(record=True, width=120, file=open("/dev/null", "w"))  # noqa: SIM115
    console.print(render(state.view(now)))
    return console.export_text()


def test_a_frame_shows_rates_gauges_step_split_and_requests():
    state = TopState("ipc:///run/tokenizer")
    state.on_request(WatchRequest(3, "early"), now=0.0)  # greeted: began before we attached
    state.on_stats(stats(10.0, steps=100, prompt=1000, cached=0, generated=500, finished=4,
                         schedule=0.1, result=0.1, busy=5.0))
    state.on_request(WatchRequest(4, "chat-4"), now=1.0)
    state.on_request(WatchRequest(5, "chat-5"), now=1.0)
    state.on_request(WatchRequest(6, "chat-6"), now=1.0)
    for t in range(4):  # 4 steps, one token each for 4 and (from the second) 3
        state.on_deltas(deltas({4: [7], **({3: [8]} if t else {})}), now=1.0 + t)
    state.on_deltas(deltas({5: [1]}), now=1.9)  # 0.1 s apart: too short a span for a rate
    state.on_deltas(deltas({5: [2]}, finish={5: FinishReason.LENGTH}), now=2.0)
    state.on_deltas(deltas({6: []}, finish={6: FinishReason.ERROR},
                           errors={6: RequestError(ErrorKind.REQUEST_FAILED, "no room")}), 2.0)
    # Two seconds later: 20 steps of 50 ms, 400 tokens generated, 600 prompt tokens computed
    # and 200 served from the cache.
    state.on_stats(stats(12.0, steps=120, prompt=1600, cached=200, generated=900, finished=6,
                         schedule=0.14, result=0.12, running=2, waiting=1, used=25, total=100,
                         busy=6.6))
    frame = text(state, now=5.0)
    assert "200.0 gen tok/s   300.0 prompt tok/s" in frame
    assert "running 2   waiting 1   finished 6   preemptions 1" in frame
    assert "generated 900   prompt 1,600   from prefix cache 200" in frame
    assert "█" * 8 + "░" * 22 + " 25/100 (25.0%)" in frame
    assert "25.0% recently   11.1% since start" in frame
    assert ("100.00 ms/step (10.0 steps/s): schedule 2.00  results 1.00  workers+idle 97.00 ms"
            in frame)
    assert "device busy 80.00 ms/step (80.0%)" in frame and "GPU" not in frame
    rows = [line.split() for line in frame.splitlines() if line.split()[:1] in
            (["3"], ["4"], ["5"], ["6"])]
    # Running first (oldest first), then finished, newest first.
    assert rows == [
        ["3", "early", "3+", "1.0", "5.0s", "generating"],
        ["4", "chat-4", "4", "1.0", "4.0s", "generating"],
        ["6", "chat-6", "0", "-", "1.0s", "error:", "no", "room"],
        ["5", "chat-5", "2", "-", "1.0s", "length"],
    ]
    assert "N+: began before top attached" in frame


def test_recent_prefix_hits_are_the_windows_own():
    state = TopState("a")
    state.on_stats(stats(1.0, prompt=90, cached=10))
    state.on_stats(stats(2.0, prompt=90, cached=10, generated=5))  # no prefill since
    assert "- recently   10.0% since start" in text(state, 0.0)
    state.on_stats(stats(3.0, prompt=90, cached=30))  # only cache hits in the window
    assert "100.0% recently   25.0% since start" in text(state, 0.0)


def test_rates_use_a_window_of_the_schedulers_time():
    state = TopState("a", window_s=2.0)
    for i in range(10):  # every 0.5 s; 10 tokens/s until 3.0, then 100 tokens/s
        t = i * 0.5
        state.on_stats(stats(t, generated=int(10 * min(t, 3.0) + 100 * max(0.0, t - 3.0))))
    assert state.stats_span_s == 2.0
    assert state.view(0.0).rates.generated_tok_s == (180 - 25) / 2.0  # from t=2.5 to t=4.5
    state.on_stats(stats(4.5, generated=999))  # a repeated time is the greeting's copy: skipped
    assert state.view(0.0).stats.generated_tokens == 180


def test_before_stats_and_after_the_end():
    state = TopState("tcp://127.0.0.1:5")
    frame = text(state, 0.0)
    assert "waiting for the first stats" in frame and "no requests yet" in frame
    assert "(q quits)" in frame
    state.on_stats(stats(1.0))
    frame = text(state, 0.0)
    assert "measuring" in frame and frame.split("prefix hits")[1].split()[0] == "-"
    state.status = "engine dead: worker 0 was killed by SIGKILL"
    frame = text(state, 0.0)
    assert "engine dead: worker 0 was killed by SIGKILL" in frame and "q quits" not in frame


def test_kv_bar_bounds():
    assert kv_bar(0, 0).plain == "░" * 30 + " 0/0 (0.0%)"
    assert kv_bar(100, 100, width=4).plain == "████ 100/100 (100.0%)"


def test_the_host_tier_row_shows_use_hits_bytes_moved_and_swaps():
    state = TopState("a")
    state.on_stats(stats(1.0))
    assert "host tier" not in text(state, 0.0)  # no tier, no row
    state.on_stats(dataclasses.replace(
        stats(2.0), host_hit_tokens=4096, host_blocks_stored=3072, host_blocks_loaded=5,
        host_blocks_used=10, host_blocks_total=40, host_swaps_out=7, host_swaps_in=6,
        host_block_bytes=1 << 20))
    frame = text(state, 0.0)
    assert "host tier" in frame and "█" * 8 + "░" * 22 + " 10/40 (25.0%)" in frame
    assert "hits 4,096 tok   stored 3.0 GiB   loaded 5.0 MiB" in frame
    assert "swaps 7 out / 6 in" in frame


def test_host_tier_moves_are_counted_in_blocks_when_their_size_is_unknown():
    state = TopState("a")
    state.on_stats(dataclasses.replace(stats(1.0), host_blocks_stored=12, host_blocks_total=4))
    frame = text(state, 0.0)
    assert "stored 12 blocks   loaded 0 blocks" in frame and "swaps 0 out / 0 in" in frame


def test_a_replica_in_hand_offs_shows_what_moved():
    state = TopState("ipc:///run/tokenizer")
    state.on_stats(stats(1.0))
    assert "KV hand-offs" not in text(state, now=1.0)
    state.on_stats(dataclasses.replace(
        stats(2.0), kv_handoffs_in=4, kv_transfer_blocks_in=12, kv_transfer_bytes_in=3 << 20,
        kv_transfer_s=0.02, kv_handoffs_in_waiting=2))
    assert "KV hand-offs  0 out (0.0 MiB) / 4 in (3.0 MiB), 5.0 ms each, waiting 0 out / 2 " \
        "in, failed 0 since start" in text(state, now=2.0)
