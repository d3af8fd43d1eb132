"""The tokenizing pool's order: small jobs first, clients in turns, one thread kept free, each
client's jobs returned in the order it sent them."""

from __future__ import annotations

import select
import threading
import time

import pytest

from frontend.actors.tokenize_pool import LARGE_JOB_BYTES, TokenizeJob, TokenizePool

SMALL, LARGE = 10, LARGE_JOB_BYTES + 1


class Recorder:
    """Handlers that log which job started, and block large jobs until released."""

    def __init__(self) -> None:
        self.started: list[str] = []
        self.release = threading.Event()
        self.lock = threading.Lock()

    def handler(self, job: TokenizeJob) -> None:
        with self.lock:
            self.started.append(job.client_request_id)
        if job.large:
            assert self.release.wait(10)
        job.result = job.client_request_id


def job(peer: bytes, name: str, size: int) -> TokenizeJob:
    return TokenizeJob(peer=peer, client_request_id=name, frame=b"", size=size)


def wait_done(pool: TokenizePool, count: int) -> list[TokenizeJob]:
    done: list[TokenizeJob] = []
    deadline = time.monotonic() + 10
    while len(done) < count:
        assert time.monotonic() < deadline, f"only {len(done)} of {count} jobs finished"
        select.select([pool.fileno()], [], [], 0.1)
        done += pool.drain()
    return done


@pytest.fixture
def recorder():
    rec = Recorder()
    yield rec
    rec.release.set()


def test_small_jobs_pass_large_ones_that_hold_the_other_threads(recorder):
    pool = TokenizePool([recorder.handler] * 3)
    try:
        for i in range(4):
            pool.submit(job(b"A", f"A-large-{i}", LARGE))
        time.sleep(0.2)
        # Two large jobs run (one thread is kept for small jobs); two wait.
        assert sorted(recorder.started) == ["A-large-0", "A-large-1"]
        pool.submit(job(b"B", "B-small", SMALL))
        assert [j.result for j in wait_done(pool, 1)] == ["B-small"]
        assert pool.pending_bytes(b"A") == 4 * LARGE and pool.pending_bytes(b"B") == 0
        recorder.release.set()
        assert len(wait_done(pool, 4)) == 4
        assert pool.pending_bytes(b"A") == 0
    finally:
        pool.close()


def test_clients_take_turns_and_queued_jobs_can_be_cancelled(recorder):
    pool = TokenizePool([recorder.handler] * 2)
    try:
        pool.submit(job(b"A", "A-0", LARGE))  # holds the only thread large jobs may use
        time.sleep(0.1)
        queued = [job(b"A", f"A-{i}", LARGE) for i in range(1, 4)]
        for j in queued:
            pool.submit(j)
        pool.submit(job(b"B", "B-0", LARGE))
        pool.submit(job(b"B", "B-1", LARGE))
        assert pool.cancel(queued[1])  # A-2 never runs
        recorder.release.set()
        done = wait_done(pool, 5)
        assert recorder.started == ["A-0", "A-1", "B-0", "A-3", "B-1"]
        assert {j.client_request_id for j in done} == {"A-0", "A-1", "A-3", "B-0", "B-1"}
    finally:
        pool.close()


def test_a_running_job_is_flagged_when_cancelled(recorder):
    pool = TokenizePool([recorder.handler] * 2)
    try:
        running = job(b"A", "A-0", LARGE)
        pool.submit(running)
        time.sleep(0.1)
        assert not pool.cancel(running) and running.cancelled
        recorder.release.set()
        assert wait_done(pool, 1) == [running]
    finally:
        pool.close()


def test_a_failing_handler_still_returns_its_job():
    def broken(j: TokenizeJob) -> None:
        raise RuntimeError("tokenizer bug")

    pool = TokenizePool([broken, broken])
    try:
        pool.submit(job(b"A", "x", SMALL))
        (done,) = wait_done(pool, 1)
        assert isinstance(done.result, RuntimeError)
    finally:
        pool.close()


def test_a_clients_jobs_come_back_in_the_order_it_sent_them():
    """A-0 is slow on one thread while the other finishes A-1 and A-2: they wait for it (the
    scheduler serves a client first come first served), and B's job does not."""
    release = threading.Event()

    def handler(j: TokenizeJob) -> None:
        if j.client_request_id == "A-0":
            assert release.wait(10)
        j.result = j.client_request_id

    pool = TokenizePool([handler, handler])
    try:
        for name in ("A-0", "A-1", "A-2"):
            pool.submit(job(b"A", name, SMALL))
        pool.submit(job(b"B", "B-0", SMALL))
        assert [j.result for j in wait_done(pool, 1)] == ["B-0"]
        time.sleep(0.2)
        assert pool.drain() == []  # are done, but A-0 is not
        release.set()
        assert [j.result for j in wait_done(pool, 3)] == ["A-0", "A-1", "A-2"]
    finally:
        release.set()
        pool.close()


def test_a_cancelled_queued_job_holds_back_none_of_its_clients_later_ones():
    release = threading.Event()

    def handler(j: TokenizeJob) -> None:
        if j.client_request_id.endswith("slow"):
            assert release.wait(10)
        j.result = j.client_request_id

    pool = TokenizePool([handler, handler])
    try:
        pool.submit(job(b"A", "A-0-slow", SMALL))
        pool.submit(job(b"B", "B-0-slow", SMALL))  # both threads are busy now
        time.sleep(0.1)
        cancelled = job(b"A", "A-1", SMALL)
        pool.submit(cancelled)
        pool.submit(job(b"A", "A-2", SMALL))
        assert pool.cancel(cancelled)
        release.set()
        done = [j.result for j in wait_done(pool, 3)]
        assert [name for name in done if name.startswith("A")] == ["A-0-slow", "A-2"]
        assert "B-0-slow" in done
    finally:
        release.set()
        pool.close()
