"""The tokenizer's links to the data-parallel replicas: each AddRequest to the scheduler the
router chose, each abort to the scheduler that holds the request, each replica's EngineStats
into the router, and a replica's death turned into errors for the requests placed there.

Owned by the tokenizer's I/O loop thread; nothing here blocks it (PUSH sends to schedulers
that are up, SUB reads only when its socket is readable).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import replace

import zmq

from frontend.router.config import RouterConfig
from frontend.router.decode_choice import DecodeChooser
from frontend.router.placement import Router
from protocol import (
    OUT_OF_BAND_STEP,
    AbortRequests,
    AddRequest,
    ErrorKind,
    FinishReason,
    ProtocolError,
    RequestError,
    TokenDeltas,
)
from protocol.auth import CurveKeys
from protocol.engine_messages import ENGINE_STATS_TOPIC, EngineStats
from protocol.kv_handoff import HandoffPeerDown
from protocol.process_runtime import ProcessRuntime
from protocol.sockets import MessageSocket

log = logging.getLogger("nanopipe.router")

MAX_TRACKED_PLACEMENTS = 1 << 18
"""Request ids whose replica is remembered (for aborts and a replica's death). The tokenizer
never learns when a request ends, so the oldest are forgotten first; an abort of a forgotten
one goes to every replica, where an unknown id is a no-op."""


class ReplicaDispatch:
    def __init__(self, rt: ProcessRuntime, config: RouterConfig,
                 keys: CurveKeys | None) -> None:
        self.router = Router(config)
        self.to_schedulers = [rt.socket(zmq.PUSH, a, bind=False, security=keys)
                              for a in config.scheduler_addresses]
        self.stats_in: list[MessageSocket] = []
        if config.num_replicas > 1:  # one replica leaves nothing to choose
            for address in config.stats_addresses:
                sub = rt.socket(zmq.SUB, address, bind=False, accepts=(EngineStats,),
                                security=keys)
                sub.socket.setsockopt(zmq.SUBSCRIBE, ENGINE_STATS_TOPIC)
                self.stats_in.append(sub)
        self._by_socket = {s.socket: r for r, s in enumerate(self.stats_in)}
        self.placed: OrderedDict[int, int] = OrderedDict()  # request id -> replica
        # Disaggregation: request id -> its decode replica (the prefill one is in `placed`).
        self.decode = DecodeChooser(config.roles) if config.roles else None
        self.paired: dict[int, int] = {}

    @property
    def poll_sockets(self) -> list[zmq.Socket]:
        return list(self._by_socket)

    def on_readable(self, zsock: zmq.Socket) -> None:
        """Drain one replica's stats socket into the router."""
        replica = self._by_socket[zsock]
        sock = self.stats_in[replica]
        while sock.poll(0):
            try:
                stats = sock.recv()
            except ProtocolError:
                continue  # a frame that arrived before the topic filter took effect
            self.router.on_stats(replica, stats)
            if self.decode is not None:
                self.decode.on_stats(replica, stats)

    def add(self, msg: AddRequest) -> bool:
        """Send a request to the replica the router picks; False when none is alive.

        Stats that have arrived are taken first: a finish's fresh stats may land while a
        burst is being placed, and every request after them should count them."""
        for zsock in self._by_socket:
            self.on_readable(zsock)
        try:
            placement = self.router.place(msg.prompt_token_ids)
            replica = placement.replica
            if self.decode is not None:
                decode = self.decode.choose(self.router.alive, placement.hashes,
                                            self.router.summaries)
                if decode >= 0:  # none alive: served whole by its prefill replica
                    msg = replace(msg, decode_replica=decode)
                    self.paired[msg.request_id] = decode
        except LookupError:
            return False
        self.placed[msg.request_id] = replica
        if len(self.placed) > MAX_TRACKED_PLACEMENTS:
            self.paired.pop(self.placed.popitem(last=False)[0], None)
        self.to_schedulers[replica].send(msg)
        return True

    def abort(self, msg: AbortRequests) -> None:
        """Each id to the replica that holds it (every live one when it was forgotten)."""
        per_replica: dict[int, list[int]] = {}
        everywhere: list[int] = []
        for rid in msg.request_ids:
            replica = self.placed.pop(rid, None)
            if replica is None:
                everywhere.append(rid)
            for r in (replica, self.paired.pop(rid, None)):  # prefill and decode: both
                if r is not None and self.router.alive[r]:
                    per_replica.setdefault(r, []).append(rid)
        for replica in self.router.live_replicas:
            ids = per_replica.get(replica, []) + everywhere
            if ids:
                self.to_schedulers[replica].send(AbortRequests(ids, msg.reason))

    def replica_down(self, replica: int, reason: str) -> TokenDeltas | None:
        """Stop placing on `replica`; the error deltas for the requests that die with it (a
        finished one among them is dropped by the detokenizer).

        A request it shared with a live replica of the other role (disaggregation) is that
        replica's to decide (HandoffPeerDown, scheduler_proc.handoff_faults): only it knows
        whether it owns the request, whose KV may have landed there already."""
        if not self.router.alive[replica]:
            return None
        self.router.mark_dead(replica)
        log.error("tokenizer: replica %d is down: %s", replica, reason)
        failed: list[int] = []
        survivors: dict[int, list[int]] = {}
        for rid in [rid for rid, r in self.placed.items()
                    if r == replica or self.paired.get(rid) == replica]:
            prefill, decode = self.placed[rid], self.paired.get(rid)
            other = decode if prefill == replica else prefill
            if decode is not None and self.router.alive[other]:
                survivors.setdefault(other, []).append(rid)
                if decode == replica:  # its prefill replica serves it whole or fails it
                    del self.paired[rid]
            else:
                failed.append(rid)
                del self.placed[rid]
                self.paired.pop(rid, None)
        for r, rids in survivors.items():
            self.to_schedulers[r].send(HandoffPeerDown(replica, reason, rids))
        if not failed:
            return None
        error = RequestError(ErrorKind.ENGINE_DEAD, f"engine dead: replica {replica}: {reason}")
        n = len(failed)
        return TokenDeltas(OUT_OF_BAND_STEP, failed, [[] for _ in failed],
                           [FinishReason.ERROR] * n, [error] * n, None)

    def refusal(self) -> str | None:
        """Why a new request cannot be placed now, or None when it can."""
        if not self.router.live_replicas:
            return "engine dead: no data-parallel replica is alive"
        if not self.router.placeable:
            return ("engine dead: no prefill replica is alive; the decode replicas only "
                    "finish the requests they hold")
        return None
