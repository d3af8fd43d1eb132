"""The scheduler process: sockets, the READY handshake and the overlapped step loop.

Socket I/O runs in two background threads: a reader decodes everything arriving (requests,
aborts, step results, engine-dead notices) into one queue, and a writer sends plans and
token deltas from another. The loop itself never blocks on ZeroMQ (a PUSH with no peer
connected yet would block a send), only on its inbox queue.

Overlap: with plan N in flight the loop sends plan N+1 before it processes result N, so
the workers never wait for the scheduler; at most one plan is queued ahead of the one
executing. Scheduler documents what that means for sequence state.
"""

from __future__ import annotations

import logging
import queue
import threading

import zmq

from protocol import (
    OUT_OF_BAND_STEP,
    AbortRequests,
    AddRequest,
    Endpoints,
    EngineDead,
    ErrorKind,
    FinishReason,
    ProtocolError,
    RequestError,
    Shutdown,
    StepResult,
    TokenDeltas,
    encode,
)
from protocol.actor_start import from_plain, read_start
from protocol.engine_messages import WatchGoodbye
from protocol.process_runtime import ProcessRuntime, Started, actor_process, start_and_serve
from protocol.sockets import MessageSocket
from scheduler_proc.config import SchedulerConfig
from scheduler_proc.deltas_publisher import DeltasPublisher
from scheduler_proc.scheduler import Scheduler

log = logging.getLogger("nanopipe.scheduler")

POLL_MS = 100


def _reader(socks: list[MessageSocket], inbox: queue.SimpleQueue, done: threading.Event) -> None:
    poller = zmq.Poller()
    for s in socks:
        poller.register(s.socket, zmq.POLLIN)
    by_socket = {s.socket: s for s in socks}
    while not done.is_set():
        for zsock, _ in poller.poll(POLL_MS):
            sock = by_socket[zsock]
            while True:
                try:
                    inbox.put(sock.recv(zmq.NOBLOCK))
                except zmq.Again:
                    break
                except ProtocolError as exc:
                    log.warning("scheduler: dropped a bad frame: %s", exc)


def _writer(outbox: queue.SimpleQueue) -> None:
    """Sends (sockets, message) pairs in order; None stops it. Encodes once per message."""
    while (item := outbox.get()) is not None:
        socks, msg = item
        frame = encode(msg)
        for sock in socks:
            try:
                sock.send_bytes(frame)
            except zmq.ZMQError as exc:  # a peer gone at shutdown; the launcher handles death
                log.warning("scheduler: send failed: %s", exc)


def _dead(reason: str) -> RequestError:
    return RequestError(ErrorKind.ENGINE_DEAD, f"engine dead: {reason}")


class SchedulerLoop:
    def __init__(self, config: SchedulerConfig, endpoints: Endpoints, world_size: int,
                 rt: ProcessRuntime) -> None:
        self.config = config
        self.sched = Scheduler(config)
        self.rt = rt
        ctx = rt.ctx
        self._keys = endpoints.keys  # every link of the scheduler is internal
        self._socks: list[MessageSocket] = []
        self.requests_in = self._sock(ctx, zmq.PULL, endpoints.scheduler_in, True,
                                      (AddRequest, AbortRequests, EngineDead, Shutdown))
        self.results_in = self._sock(ctx, zmq.PULL, endpoints.step_results, True, (StepResult,))
        self.publisher = DeltasPublisher(ctx, endpoints.deltas_pub, security=self._keys,
                                         stats=self.sched.stats)
        self.deltas_pub = self.publisher.sink  # the writer's way to the attached watchers
        self.to_detok = self._sock(ctx, zmq.PUSH, endpoints.detok_in, False)
        self.to_workers = [self._sock(ctx, zmq.PUSH, a, endpoints.scheduler_binds_steps)
                           for a in endpoints.worker_steps[:world_size]]
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._done = threading.Event()
        self._threads = [
            threading.Thread(target=_reader, args=([self.requests_in, self.results_in],
                                                   self.inbox, self._done),
                             name="scheduler-reader", daemon=True),
            threading.Thread(target=_writer, args=(self.outbox,), name="scheduler-writer",
                             daemon=True),
        ]
        self.plans_in_flight = 0
        self.dead_reason: str | None = None
        self.shutdown = False

    def _sock(self, ctx, kind, address, bind, accepts=()) -> MessageSocket:
        sock = MessageSocket(ctx, kind, address, bind=bind, accepts=accepts, security=self._keys)
        self._socks.append(sock)
        return sock

    # ------------------------------------------------------------ messages

    def _emit(self, deltas: TokenDeltas | None) -> None:
        if deltas is not None and deltas.request_ids:
            self.outbox.put(((self.to_detok, self.deltas_pub), deltas))
            self.publisher.forget_finished(deltas)

    def _handle(self, msg: object) -> None:
        sched = self.sched
        if isinstance(msg, StepResult):
            self.plans_in_flight -= 1
            if self.dead_reason is None:
                self._emit(sched.process_result(msg))
        elif isinstance(msg, AddRequest):
            # Watchers learn the client's name of a request before any of its tokens.
            self.outbox.put(((self.deltas_pub,), self.publisher.announce(
                msg.request_id, msg.client_request_id)))
            if self.dead_reason is not None:
                self._emit(TokenDeltas(OUT_OF_BAND_STEP, [msg.request_id], [[]],
                                       [FinishReason.ERROR], [_dead(self.dead_reason)], None))
            else:
                sched.add_request(msg)
        elif isinstance(msg, AbortRequests):
            sched.abort(msg.request_ids, msg.reason)
        elif isinstance(msg, EngineDead):
            self._die(msg.reason)
        elif isinstance(msg, Shutdown):
            self.shutdown = True
        self._emit(sched.pop_deltas())

    def _die(self, reason: str) -> None:
        """A worker or the detokenizer died: fail every request instead of hanging."""
        if self.dead_reason is None:
            self.dead_reason = reason
            log.error("scheduler: engine dead: %s", reason)
            self._emit(self.sched.fail_all(_dead(reason)))
            self.publisher.dead_reason = reason
            self.outbox.put(((self.deltas_pub,), WatchGoodbye(reason, engine_dead=True)))

    # ------------------------------------------------------------ loop

    def run(self) -> None:
        for t in self._threads:
            t.start()
        max_in_flight = self.config.max_plans_in_flight
        sched = self.sched
        was_busy = False
        while not self.shutdown and self.rt.stop_reason is None:
            # Take everything already here: results first free blocks for the next plan.
            try:
                while True:
                    self._handle(self.inbox.get_nowait())
            except queue.Empty:
                pass
            if self.dead_reason is None and self.plans_in_flight < max_in_flight:
                plan = sched.schedule()
                if plan is not None:
                    self.outbox.put((self.to_workers, plan))
                    self.plans_in_flight += 1
                    was_busy = True
                    # Overlap: go straight on to plan N+1 (and N+2: plans_ahead) while N runs.
                    continue
            if was_busy and self.plans_in_flight == 0 and not sched.has_unfinished():
                was_busy = False
                self._check_idle()
            try:
                self._handle(self.inbox.get(timeout=POLL_MS / 1000))
            except queue.Empty:
                pass
        if self.shutdown:
            self.outbox.put((self.to_workers, Shutdown("scheduler shutting down")))

    def _check_idle(self) -> None:
        try:
            self.sched.check_integrity()
        except AssertionError as exc:
            log.error("scheduler: invariant broken while idle: %s", exc)

    def _goodbye(self) -> tuple[str, bool]:
        """Why the watchers lose this pipeline, and whether that is the engine's death."""
        if self.dead_reason is not None:
            return self.dead_reason, True
        if self.shutdown:
            return "the pipeline shut down", False
        if self.rt.stop_reason is not None:
            return f"the pipeline stopped ({self.rt.stop_reason})", False
        return "the scheduler stopped unexpectedly", True

    def serve(self) -> None:
        """Run the step loop; a bug fails what is in flight first, so no client waits on it,
        then propagates so the launcher declares the engine dead."""
        try:
            self.run()
        except Exception as exc:
            log.exception("scheduler: loop failed")
            self._emit(self.sched.fail_all(_dead(f"scheduler error: {exc}")))
            raise

    def close(self) -> None:
        self._done.set()
        self.outbox.put(None)
        for t in self._threads:
            t.join(timeout=2.0)
        self.publisher.close(*self._goodbye())
        for sock in reversed(self._socks):
            sock.close()


def run_scheduler(config: SchedulerConfig, endpoints: Endpoints, world_size: int) -> None:
    """Process entry point of the scheduler."""
    loop: SchedulerLoop | None = None
    with actor_process("scheduler", endpoints) as rt:
        def start() -> Started:
            nonlocal loop
            config.check_pool_fits_model_len()
            loop = SchedulerLoop(config, endpoints, world_size, rt)
            return Started(loop.serve, f"kv_blocks={config.num_kv_blocks} "
                           f"block_size={config.block_size} overlap={config.overlap} "
                           f"plans_in_flight={config.max_plans_in_flight}",
                           num_kv_blocks=config.num_kv_blocks)

        try:
            start_and_serve(rt, endpoints, start)
        finally:
            if loop is not None:
                loop.close()  # its threads and sockets, before the runtime ends the context


def main() -> None:
    """`python -m scheduler_proc.scheduler_loop`, started by the launcher (spec on stdin)."""
    start = read_start()
    run_scheduler(from_plain(SchedulerConfig, start.config["scheduler"]),
                  from_plain(Endpoints, start.config["endpoints"]), start.config["world_size"])


if __name__ == "__main__":
    main()
