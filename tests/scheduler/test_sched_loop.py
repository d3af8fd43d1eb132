"""The scheduler process loop over real sockets, with a fake worker and detokenizer."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import psutil
import pytest
import zmq
from fake_worker import Collector, FakeWorker, make_request, reference_generate

from protocol import (
    AbortRequests,
    Endpoints,
    EngineDead,
    ErrorKind,
    FinishReason,
    Ready,
    Shutdown,
    StartupFailed,
    StepPlan,
    TokenDeltas,
)
from protocol.sockets import MessageSocket
from scheduler_proc import SchedulerConfig
from scheduler_proc.scheduler_loop import run_scheduler

pytestmark = pytest.mark.timeout(60)


class Harness:
    """Everything around a scheduler: control, one worker rank, detokenizer, frontend."""

    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.ep = Endpoints.ipc(1)
        self.ctx = zmq.Context()
        self.control = MessageSocket(self.ctx, zmq.PULL, self.ep.control, bind=True,
                                     accepts=(Ready, StartupFailed))
        self.detok = MessageSocket(self.ctx, zmq.PULL, self.ep.detok_in, bind=True,
                                   accepts=(TokenDeltas,))
        self.worker_stalled = threading.Event()
        self.worker = FakeWorker(config.num_kv_blocks, config.block_size)
        self.worker_thread = threading.Thread(target=self._worker, daemon=True)
        self.worker_ready = threading.Event()
        self.worker_thread.start()
        self.worker_ready.wait(5)
        self.sched_thread = threading.Thread(target=run_scheduler, args=(config, self.ep, 1),
                                             daemon=True)
        self.sched_thread.start()
        assert self.control.poll(10_000)
        ready = self.control.recv()
        assert isinstance(ready, Ready) and ready.role == "scheduler"
        self.front = MessageSocket(self.ctx, zmq.PUSH, self.ep.scheduler_in, bind=False)
        self.collector = Collector()

    def _worker(self) -> None:
        steps = MessageSocket(self.ctx, zmq.PULL, self.ep.worker_steps[0], bind=True,
                              accepts=(StepPlan, Shutdown))
        results = MessageSocket(self.ctx, zmq.PUSH, self.ep.step_results, bind=False)
        self.worker_ready.set()
        try:
            while True:
                if not steps.poll(50):
                    continue
                msg = steps.recv()
                if isinstance(msg, Shutdown):
                    return
                if self.worker_stalled.is_set():
                    continue  # a hung worker: never answers
                results.send(self.worker.execute(msg))
        finally:
            steps.close()
            results.close()

    def collect_until(self, done, timeout=20.0) -> Collector:
        deadline = time.monotonic() + timeout
        while not done(self.collector.outputs):
            assert time.monotonic() < deadline, "timed out waiting for deltas"
            if self.detok.poll(100):
                self.collector.add(self.detok.recv())
        return self.collector

    def close(self) -> None:
        self.front.send(Shutdown("test over"))
        self.sched_thread.join(10)
        assert not self.sched_thread.is_alive()
        self.worker_thread.join(10)
        for s in (self.front, self.detok, self.control):
            s.close()
        self.ctx.term()
        self.ep.cleanup()


def finished(ids):
    return lambda outs: all(i in outs and outs[i].finish_reason for i in ids)


@pytest.mark.parametrize("overlap,spin_s", [(True, 0.0), (False, 0.0), (True, 2e-3)])
def test_loop_serves_requests_to_completion(overlap, spin_s):
    cfg = SchedulerConfig(12, 4, max_num_batched_tokens=16, max_model_len=40, overlap=overlap,
                          result_spin_s=spin_s)
    h = Harness(cfg)
    try:
        reqs = [make_request(i, 3 + i, max_tokens=6 + i, eos=[1]) for i in range(8)]
        for r in reqs:
            h.front.send(r)
        out = h.collect_until(finished(range(8))).outputs
        for r in reqs:
            ref = reference_generate(r.prompt_token_ids, r.params, r.eos_token_ids, 40)
            assert (out[r.request_id].token_ids, out[r.request_id].finish_reason) == ref
        h.front.send(make_request(50, 60, max_tokens=4))
        out = h.collect_until(finished([50])).outputs
        assert out[50].finish_reason is FinishReason.ERROR
        assert "max_model_len" in out[50].error.message
    finally:
        h.close()


def _loop_cpu_share(h: Harness, seconds: float = 1.0) -> float:
    thread = next(t for t in psutil.Process().threads() if t.id == h.sched_thread.native_id)
    start = time.monotonic()
    time.sleep(seconds)
    after = next(t for t in psutil.Process().threads() if t.id == thread.id)
    used = after.user_time + after.system_time - thread.user_time - thread.system_time
    return used / (time.monotonic() - start)


def test_an_idle_loop_sleeps_though_it_spins_for_results():
    """With the spin a GPU engine gets, the loop polls without sleeping only while a result
    is due: once the requests are served its thread uses next to no CPU."""
    cfg = SchedulerConfig(32, 4, max_model_len=64, plans_ahead=2, result_spin_s=5e-3)
    h = Harness(cfg)
    try:
        reqs = [make_request(i, 5, max_tokens=20, ignore_eos=True) for i in range(3)]
        for r in reqs:
            h.front.send(r)
        h.collect_until(finished(range(3)))
        time.sleep(0.3)  # the last result's bookkeeping
        # A spinning loop takes a whole core (~1.0); a sleeping one a few wake-ups, which a
        # loaded 2-core machine stretches to a few per cent.
        assert _loop_cpu_share(h) < 0.1
    finally:
        h.close()


def test_a_dead_engine_with_plans_in_flight_leaves_the_loop_asleep():
    """Once the engine died no result is awaited: the spin for results stops with it."""
    cfg = SchedulerConfig(32, 4, max_model_len=64, plans_ahead=2, result_spin_s=5e-3)
    h = Harness(cfg)
    try:
        h.front.send(make_request(1, 5, max_tokens=50, ignore_eos=True))
        h.collect_until(lambda outs: 1 in outs and outs[1].token_ids)
        h.worker_stalled.set()  # plans stay in flight
        time.sleep(0.3)
        h.front.send(EngineDead("worker 0 exited with code -9"))
        h.collect_until(finished([1]))
        time.sleep(0.3)
        assert _loop_cpu_share(h) < 0.02
    finally:
        h.close()


def test_loop_abort_and_engine_dead():
    cfg = SchedulerConfig(32, 4, max_model_len=64)
    h = Harness(cfg)
    try:
        h.front.send(make_request(1, 5, max_tokens=50, ignore_eos=True))
        h.collect_until(lambda outs: 1 in outs and outs[1].token_ids)
        h.front.send(AbortRequests([1], FinishReason.ABORT))
        out = h.collect_until(finished([1])).outputs
        assert out[1].finish_reason == FinishReason.ABORT and len(out[1].token_ids) < 50
        h.worker_stalled.set()
        h.front.send(make_request(2, 5, max_tokens=50, ignore_eos=True))
        time.sleep(0.3)
        h.front.send(EngineDead("worker 0 exited with code -9"))
        out = h.collect_until(finished([2])).outputs
        assert out[2].finish_reason is FinishReason.ERROR
        assert out[2].error.kind is ErrorKind.ENGINE_DEAD
        h.front.send(make_request(3, 5, max_tokens=5))
        out = h.collect_until(finished([3])).outputs
        assert out[3].finish_reason is FinishReason.ERROR
        assert out[3].error.kind is ErrorKind.ENGINE_DEAD
    finally:
        h.close()


def test_pool_smaller_than_max_model_len_refuses_to_start():
    ep = Endpoints.ipc(1)
    ctx = zmq.Context()
    control = MessageSocket(ctx, zmq.PULL, ep.control, bind=True, accepts=(Ready, StartupFailed))
    try:
        cfg = SchedulerConfig(2, 4, max_model_len=64)
        errors = []

        def target():
            try:
                run_scheduler(cfg, ep, 1)
            except SystemExit as exc:
                errors.append(exc)

        t = threading.Thread(target=target)  # a thread: keep pytest's signal handlers
        t.start()
        t.join(10)
        assert errors
        assert control.poll(5000)
        msg = control.recv()
        assert isinstance(msg, StartupFailed) and "max_model_len" in msg.error
    finally:
        control.close()
        ctx.term()
        ep.cleanup()


def test_scheduler_never_imports_torch():
    code = ("import sys, scheduler_proc, scheduler_proc.scheduler_loop; "
            "sys.exit('torch' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0
