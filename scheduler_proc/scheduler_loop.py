"""The scheduler process: sockets, the READY handshake and the overlapped step loop.

One thread owns every socket: it takes what has arrived (step results first, then requests,
aborts and engine-dead notices), plans, and sends. The chain from a step's result to the next
plan paces decoding at small batches, so nothing else sits on it: no thread hand-off (each
costs a wake-up), and the token deltas of the results just taken go out after that plan (their
encoding and two sends are not on the chain). Sends never block
(scheduler_proc.nonblocking_sender). While
a result is due the loop polls without sleeping for `result_spin_s` (a wake-up from a blocking
poll takes tens of µs or more on an idle host), then blocks.

Overlap: with plan N in flight the loop sends plan N+1 before it processes result N, so
the workers never wait for the scheduler; how many plans it keeps in flight, and how long it
spins, it asks the scheduler's PlanDepth (scheduler_proc.plans_in_flight has the rule).
Scheduler documents what overlap means for sequence state.
"""

from __future__ import annotations

import logging
import time

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
)
from protocol.actor_start import from_plain, read_start
from protocol.engine_messages import WatchGoodbye, WatchRequest
from protocol.kv_handoff import (
    HandoffAccept,
    HandoffCancel,
    HandoffOffer,
    HandoffPeerDown,
    HandoffRelease,
    KVLanded,
    KVLinks,
)
from protocol.process_runtime import ProcessRuntime, Started, actor_process, start_and_serve
from protocol.profile_settings import host_timeline
from protocol.sockets import MessageSocket
from scheduler_proc.config import SchedulerConfig
from scheduler_proc.deltas_publisher import DeltasPublisher
from scheduler_proc.nonblocking_sender import FLUSH_RETRY_S, Outbox
from scheduler_proc.scheduler import Scheduler

log = logging.getLogger("nanopipe.scheduler")

HANDOFF_MESSAGES = (HandoffOffer, HandoffAccept, HandoffRelease, HandoffCancel, KVLanded,
                    HandoffPeerDown)
POLL_MS = 100
IDLE_CHECK_AFTER_S = 1.0
"""How long the loop stays without work before it checks the scheduler's invariants."""
CLOSE_DRAIN_S = 1.0
"""How long closing waits for frames that no peer could take yet (the workers' Shutdown)."""


def _dead(reason: str) -> RequestError:
    return RequestError(ErrorKind.ENGINE_DEAD, f"engine dead: {reason}")


class SchedulerLoop:
    def __init__(self, config: SchedulerConfig, endpoints: Endpoints, world_size: int,
                 rt: ProcessRuntime, links: KVLinks | None = None) -> None:
        self.config = config
        self.sched = Scheduler(config)
        self.rt = rt
        ctx = rt.ctx
        self._keys = endpoints.keys  # every link of the scheduler is internal
        self._socks: list[MessageSocket] = []
        self.requests_in = self._sock(ctx, zmq.PULL, endpoints.scheduler_in, True,
                                      (AddRequest, AbortRequests, EngineDead, Shutdown,
                                       *HANDOFF_MESSAGES))
        self.results_in = self._sock(ctx, zmq.PULL, endpoints.step_results, True, (StepResult,))
        self.publisher = DeltasPublisher(ctx, endpoints.deltas_pub, security=self._keys,
                                         stats=self.sched.stats)
        self.deltas_pub = self.publisher.sink  # the way to the attached watchers
        self.to_detok = self._sock(ctx, zmq.PUSH, endpoints.detok_in, False)
        self.to_workers = [self._sock(ctx, zmq.PUSH, a, endpoints.scheduler_binds_steps)
                           for a in endpoints.worker_steps[:world_size]]
        self.outbox = Outbox()
        # Prefill/decode disaggregation: the other role's schedulers, by replica index.
        self.to_peers = {r: self._sock(ctx, zmq.PUSH, a, False)
                         for r, a in enumerate(links.peer_schedulers if links else ()) if a}
        self._poller = zmq.Poller()
        for sock in (self.results_in, self.requests_in):
            self._poller.register(sock.socket, zmq.POLLIN)
        self.plans_in_flight = 0
        self.dead_reason: str | None = None
        self.shutdown = False
        self.timeline = host_timeline("scheduler")
        self._deltas: list[TokenDeltas] = []
        self._to_peers: list[tuple[int, object]] = []

    def _sock(self, ctx, kind, address, bind, accepts=()) -> MessageSocket:
        sock = MessageSocket(ctx, kind, address, bind=bind, accepts=accepts, security=self._keys)
        self._socks.append(sock)
        return sock

    # ------------------------------------------------------------ messages

    def _emit(self, deltas: TokenDeltas | None) -> None:
        """Queue deltas for the detokenizer and the watchers, sent in order by _flush_deltas:
        after the plan that follows them, when there is one (run)."""
        if deltas is not None and (deltas.request_ids or deltas.continued_ids):
            self._deltas.append(deltas)

    def _flush_deltas(self) -> None:
        publisher = self.publisher
        for deltas in self._deltas:
            finishes = publisher.note_finishes(deltas)  # before the frame wakes its thread
            self.outbox.send((self.to_detok, self.deltas_pub), deltas)
            if finishes:
                publisher.forget_finished(deltas)
        self._deltas.clear()
        for replica, msg in self._to_peers:
            peer = self.to_peers.get(replica)
            if peer is not None:
                self.outbox.send((peer,), msg)
        self._to_peers.clear()

    def _handle(self, msg: object) -> None:
        sched = self.sched
        if isinstance(msg, StepResult):
            self.timeline.mark(msg.step_id, "result_in")
            self.plans_in_flight = max(0, self.plans_in_flight - 1)  # 0 from a death on
            if self.dead_reason is None:
                self._emit(sched.process_result(msg))
            self.timeline.mark(msg.step_id, "result_done")
        elif isinstance(msg, AddRequest):
            # Watchers learn the client's name of a request before any of its tokens.
            self.outbox.send((self.deltas_pub,), self.publisher.announce(WatchRequest(
                msg.request_id, msg.client_request_id, list(msg.params.stop),
                msg.params.include_stop_str_in_output)))
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
        elif isinstance(msg, HANDOFF_MESSAGES) and self.dead_reason is None:
            sched.on_handoff(msg)
            if isinstance(msg, HandoffPeerDown) and msg.replica in self.to_peers:
                self.outbox.forget(self.to_peers.pop(msg.replica))  # nothing goes there now
        self._pump_handoffs()
        self._emit(sched.pop_deltas())

    def _pump_handoffs(self) -> None:
        """Send what the hand-offs produced: to the ranks before any later plan (a KVCancel
        must precede the plans that reuse its blocks), to the peers after the deltas of
        this step are queued (a first token reaches the detokenizer before the second)."""
        handoffs = self.sched.handoffs
        if handoffs is None or self.dead_reason is not None:
            return
        handoffs.tick()
        for msg in handoffs.worker_out:
            self.outbox.send(self.to_workers, msg)
        handoffs.worker_out.clear()
        self._to_peers.extend(handoffs.peer_out)
        handoffs.peer_out.clear()

    def _die(self, reason: str) -> None:
        """A worker or the detokenizer died: fail every request instead of hanging."""
        if self.dead_reason is None:
            self.dead_reason = reason
            log.error("scheduler: engine dead: %s", reason)
            self._emit(self.sched.fail_all(_dead(reason)))
            self.plans_in_flight = 0  # no result is awaited: the loop must not spin for one
            self._flush_deltas()  # every failure before the goodbye
            self.publisher.dead_reason = reason
            self.outbox.send((self.deltas_pub,), WatchGoodbye(reason, engine_dead=True))

    # ------------------------------------------------------------ loop

    def run(self) -> None:
        sched = self.sched
        was_busy = False
        idle_since: float | None = None
        while not self.shutdown and self.rt.stop_reason is None:
            # Take everything already here: results first free blocks for the next plan.
            self._take_arrived()
            self._pump_handoffs()
            if self.dead_reason is None and sched.may_plan(self.plans_in_flight):
                plan = sched.schedule()
                if plan is not None:
                    self.timeline.mark(plan.step_id, "plan_out")  # encoding is the hop's
                    self.outbox.send(self.to_workers, plan)
                    self.plans_in_flight += 1
                    was_busy, idle_since = True, None
                    self._flush_deltas()
                    # Overlap: go straight on to plan N+1 (and N+2) while N runs: may_plan.
                    continue
            self._flush_deltas()
            if was_busy and self.plans_in_flight == 0 and not sched.has_unfinished():
                # The integrity check goes over the whole pool: it waits for a quiet spell,
                # so a light load does not pay it per request nor a new one wait behind it.
                now = time.monotonic()
                if idle_since is None:
                    idle_since = now
                elif now - idle_since >= IDLE_CHECK_AFTER_S:
                    was_busy = False
                    self._check_idle()
            self._wait()
        if self.shutdown:
            self.outbox.send(self.to_workers, Shutdown("scheduler shutting down"))

    def _take_arrived(self) -> None:
        for sock in (self.results_in, self.requests_in):
            while True:
                try:
                    msg = sock.recv(zmq.NOBLOCK)
                except zmq.Again:
                    break
                except ProtocolError as exc:
                    log.warning("scheduler: dropped a bad frame: %s", exc)
                    continue
                self._handle(msg)

    def _wait(self) -> None:
        """Until something arrives, POLL_MS at most (the stop flag is checked between)."""
        self.outbox.flush()
        spin_s = self.sched.depth.spin_s(self.plans_in_flight)
        if spin_s > 0:
            spin_until = time.perf_counter() + spin_s
            while time.perf_counter() < spin_until:
                if self._poller.poll(0):
                    return
        timeout_s = FLUSH_RETRY_S if self.outbox.has_waiting else POLL_MS / 1000
        self._poller.poll(timeout_s * 1000)

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
        self._flush_deltas()  # what a failing loop emitted last (serve)
        if not self.outbox.drain(CLOSE_DRAIN_S):
            log.warning("scheduler: closing with frames no peer took")
        self.publisher.close(*self._goodbye())
        for sock in reversed(self._socks):
            sock.close()
        self.timeline.write()


def run_scheduler(config: SchedulerConfig, endpoints: Endpoints, world_size: int,
                  links: KVLinks | None = None) -> None:
    """Process entry point of the scheduler."""
    loop: SchedulerLoop | None = None
    with actor_process("scheduler", endpoints) as rt:
        def start() -> Started:
            nonlocal loop
            config.check_pool_fits_model_len()
            loop = SchedulerLoop(config, endpoints, world_size, rt, links)
            return Started(loop.serve, f"kv_blocks={config.num_kv_blocks} "
                           f"block_size={config.block_size} overlap={config.overlap} "
                           f"plans_in_flight={config.max_plans_in_flight}",
                           num_kv_blocks=config.num_kv_blocks)

        try:
            start_and_serve(rt, endpoints, start)
        finally:
            if loop is not None:
                loop.close()  # its sockets and publisher thread, before the context ends


def main() -> None:
    """`python -m scheduler_proc.scheduler_loop`, started by the launcher (spec on stdin)."""
    start = read_start()
    links = start.config.get("kv_links")
    run_scheduler(from_plain(SchedulerConfig, start.config["scheduler"]),
                  from_plain(Endpoints, start.config["endpoints"]), start.config["world_size"],
                  None if links is None else from_plain(KVLinks, links))


if __name__ == "__main__":
    main()
