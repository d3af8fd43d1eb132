"""Prefill/decode hand-offs of one replica, without sockets (protocol.kv_handoff has the flow).

Prefill side: a sequence whose first token arrived (and did not end it) leaves the running set
holding its blocks (status HANDOFF) and is offered to its decode replica. When that replica
accepts, the export goes to the ranks once the blocks exporting stay under
`max_transfer_blocks` (the bound on KV bytes in flight); the blocks are freed when the decode
replica releases them (full ones stay in the prefix cache).

Decode side: an offer gets its blocks when the pool has room (offers queue in arrival order
meanwhile); the accept goes out only once no plan sent before the allocation is in flight,
since such a plan may still write a block freed just before it (overlap) and the transfer
lands outside the plan stream. When every rank has landed, the sequence waits in `landed` for
admission (step_planner: its KV counts as computed, the first token is computed there), and
the prefill replica is released.

Decode side, reuse: the offer's leading full blocks that this replica's prefix cache holds (an
earlier turn of the conversation decoded here) are taken from it and not transferred; the
accept says how many, and with all of them held the hand-off lands at once.

Faults: a transfer not landed `transfer_timeout_s` after the accept fails the request (the
decode side gives up and says why; the prefill side, as a backstop for a silent peer, after
twice that); a peer's death and the engine's: handoff_faults. The loop sends `peer_out`
(to other schedulers) and `worker_out` (to its ranks, ordered with the plans) after each call.
"""

from __future__ import annotations

import time
from collections import OrderedDict, deque

from protocol import ErrorKind, FinishReason, RequestError
from protocol.kv_handoff import (
    HandoffAccept,
    HandoffCancel,
    HandoffOffer,
    HandoffRelease,
    KVCancel,
    KVExport,
    KVLanded,
)
from scheduler_proc.handoff_entries import HandoffCounters, InEntry, OutEntry, offered_sequence
from scheduler_proc.sequence import Sequence, SequenceStatus
from scheduler_proc.state import SchedulerState
from scheduler_proc.stats import request_metrics

HANDOFF, FINISHED = SequenceStatus.HANDOFF, SequenceStatus.FINISHED
MAX_REFUSED_IDS = 4096
"""Ids aborted on a decode replica before their offer arrived, remembered to refuse it."""


class Handoffs:
    def __init__(self, state: SchedulerState) -> None:
        config = state.config
        self.state = state
        self.role, self.replica, self.ranks = config.role, config.replica, config.handoff_ranks
        self.timeout_s = config.transfer_timeout_s
        self.max_blocks = config.max_transfer_blocks or max(1, config.num_kv_blocks // 4)
        self.peer_out: list[tuple[int, object]] = []
        self.worker_out: list[object] = []
        self.counters = HandoffCounters()
        self.seqs: dict[int, Sequence] = {}
        """Sequences in a hand-off (status HANDOFF): not among the scheduler's own (running,
        waiting, fair shares) while they hold blocks between replicas."""
        self.client_keys: dict[int, str] = {}
        self.out: dict[int, OutEntry] = {}
        self.export_queue: deque[int] = deque()
        self.blocks_exporting = 0
        self.offers: deque[HandoffOffer] = deque()
        self.incoming: dict[int, InEntry] = {}
        self.landed: deque[Sequence] = deque()
        self.refused: OrderedDict[int, None] = OrderedDict()
        self.exported_ended: OrderedDict[int, int] = OrderedDict()
        """Prefill side: blocks of requests that ended here after their export went out; the
        transfer may still land, and its release is counted then."""
        self.dead_peers: dict[int, RequestError] = {}  # died: their error (handoff_faults)

    @property
    def waiting(self) -> int:
        """Hand-offs not finished on this side (the stats' gauge)."""
        return len(self.out) + len(self.offers) + len(self.incoming)

    def stats_fields(self) -> dict[str, int | float]:  # this replica's EngineStats.kv_*
        return self.counters.stats_fields(self.role, self.waiting)

    # ------------------------------------------------------------ prefill side

    def hand_off(self, seq: Sequence) -> None:
        """seq just got its first token and goes on: offer it; the caller drops it from
        running. Its blocks stay held; the workers forget their mirror (the export names
        blocks, not the sequence)."""
        state, now = self.state, time.monotonic()
        seq.status = HANDOFF
        seq.client.running -= 1
        del state.seqs[seq.seq_id]
        state.waiting.forget_if_idle(seq.client)
        self.seqs[seq.seq_id] = seq
        if seq.on_worker:
            state.drops.append(seq.seq_id)
            seq.on_worker = False
        num_blocks = state.block_manager.blocks_for(seq.num_computed)
        self.out[seq.seq_id] = OutEntry(seq, seq.decode_replica, num_blocks)
        first = seq.first_scheduled_s
        self.peer_out.append((seq.decode_replica, HandoffOffer(
            seq.seq_id, self.replica, seq.token_ids, seq.num_prompt_tokens, seq.num_computed,
            seq.params, sorted(seq.stop_tokens), seq.arrival_time,
            (now if first is None else first) - seq.arrival_s,
            (seq.first_token_s or now) - seq.arrival_s, seq.num_cached_prompt,
            seq.num_host_prompt, seq.num_preemptions, num_blocks, seq.client.key)))

    def on_accept(self, msg: HandoffAccept) -> None:
        entry, reused = self.out.get(msg.request_id), msg.reused_blocks
        if (entry is None or entry.dest is not None or not 0 <= reused <= entry.num_blocks
                or len(msg.block_ids) + reused != entry.num_blocks):
            # Ended (or given up) meanwhile, or a malformed answer: the decode side frees.
            self.peer_out.append((msg.decode_replica, HandoffCancel(msg.request_id)))
            if entry is not None and entry.dest is None:
                self.fail(entry.seq, f"decode replica {msg.decode_replica} answered with "
                           f"{len(msg.block_ids)} blocks and {reused} reused, "
                           f"{entry.num_blocks} expected")
            return
        entry.dest, entry.reused = list(msg.block_ids), reused
        entry.accepted_s = time.monotonic()
        if entry.num_moved:
            self.export_queue.append(msg.request_id)
            self._export()
        else:  # the decode replica held every block: its release follows
            entry.exported = True

    def _export(self) -> None:
        """Exports in accept order while the blocks in flight stay under the bound (one
        export always goes, however large, so none waits forever)."""
        while self.export_queue:
            entry = self.out[self.export_queue[0]]
            n = entry.num_moved
            if self.blocks_exporting and self.blocks_exporting + n > self.max_blocks:
                return
            self.export_queue.popleft()
            seq = entry.seq
            self.worker_out.append(KVExport(seq.seq_id, seq.block_table[entry.reused:
                                                                        entry.num_blocks],
                                            entry.decode_replica, entry.dest))
            entry.exported = True
            self.blocks_exporting += n

    def end_out(self, rid: int) -> OutEntry | None:
        """Prefill side: take rid's hand-off out, and its blocks out of those exporting."""
        entry = self.out.pop(rid, None)
        if entry is None:
            return None
        if entry.exported:
            self.blocks_exporting -= entry.num_moved
        elif entry.dest is not None:
            self.export_queue.remove(rid)
        self._export()
        return entry

    def on_release(self, msg: HandoffRelease) -> None:
        entry = self.end_out(msg.request_id)
        if entry is None:
            ended_blocks = self.exported_ended.pop(msg.request_id, None)
            if ended_blocks is not None and msg.landed:
                self.counters.count_out(ended_blocks, msg.num_bytes)
            return
        seq = entry.seq
        if not msg.landed:
            self.fail(seq, msg.error)
            return
        self.counters.count_out(entry.num_moved, msg.num_bytes)
        # The decode replica owns the request now: free silently, no end of ours.
        self._free(seq)

    def _free(self, seq: Sequence) -> None:
        bm = self.state.block_manager
        bm.hash_full_blocks(seq)
        bm.free(seq)
        seq.status = FINISHED
        del self.seqs[seq.seq_id]
        self.client_keys.pop(seq.seq_id, None)

    def end(self, seq: Sequence, reason: FinishReason, error: RequestError | None) -> None:
        """End a request this side owns while it is in a hand-off: its final delta and
        metrics, as SchedulerState.finish does for the others."""
        self.forget(seq)
        self._free(seq)
        seq.finish_reason = reason
        state = self.state
        metrics = request_metrics(seq, reason, time.monotonic())
        state.deltas.add(seq.seq_id, [], reason, error)
        state.deltas.add_metrics(seq.seq_id, metrics)
        state.stats.record(metrics)

    def fail(self, seq: Sequence, why: str) -> None:
        self.counters.failures += 1
        self.end(seq, FinishReason.ERROR, RequestError(ErrorKind.REQUEST_FAILED, why))

    # ------------------------------------------------------------ decode side

    def on_offer(self, msg: HandoffOffer) -> None:
        rid = msg.request_id
        error = self.dead_peers.get(msg.prefill_replica)
        if error is not None:  # queued behind its replica's death, which failed it
            self.state.deltas.add(rid, [], FinishReason.ERROR, error)
            return
        if rid in self.refused or rid in self.state.seqs or rid in self.seqs:
            self.refused.pop(rid, None)
            self.peer_out.append((msg.prefill_replica, HandoffCancel(rid)))
            return
        self.offers.append(msg)
        self.admit_offers()

    def admit_offers(self) -> None:
        """Allocate blocks for queued offers, oldest first, while the pool has room."""
        state = self.state
        bm = state.block_manager
        while self.offers:
            msg = self.offers[0]
            seq = offered_sequence(msg, state.config.max_model_len)
            # Leading full blocks of the KV this replica computed already (an earlier turn
            # of the conversation decoded here): held, not transferred.
            prefix = bm.find_cached_prefix(msg.token_ids[:msg.num_computed + 1])
            if bm.allocate(seq, msg.num_computed, prefix) is None:
                return
            self.offers.popleft()
            self.client_keys[seq.seq_id] = msg.client_key
            self.seqs[seq.seq_id] = seq
            self.incoming[seq.seq_id] = InEntry(seq, msg.prefill_replica, state.next_step_id - 1,
                                                reused=prefix.num_blocks)

    def on_landed(self, msg: KVLanded) -> None:
        entry = self.incoming.get(msg.request_id)
        if entry is None or entry.accept_sent_s is None:
            return  # cancelled meanwhile: its late report means nothing
        if not msg.ok:
            self.give_up(entry, f"KV transfer from prefill replica {entry.prefill_replica} to "
                          f"decode replica {self.replica} failed on rank {msg.rank}: {msg.error}")
            return
        entry.ranks.add(msg.rank)
        entry.num_bytes += msg.num_bytes
        if len(entry.ranks) == self.ranks:
            self._landed(entry)

    def _landed(self, entry: InEntry) -> None:
        seq = entry.seq
        del self.incoming[seq.seq_id]
        seq.kv_transfer_s = time.monotonic() - entry.accept_sent_s
        self.landed.append(seq)
        c = self.counters
        c.handoffs_in += 1
        c.blocks_in += len(seq.block_table) - entry.reused
        c.blocks_reused += entry.reused
        c.bytes_in += entry.num_bytes
        c.transfer_s += seq.kv_transfer_s
        self.peer_out.append((entry.prefill_replica, HandoffRelease(
            seq.seq_id, True, entry.num_bytes, seq.kv_transfer_s)))

    def give_up(self, entry: InEntry, why: str) -> None:
        self.counters.failures += 1
        self.drop(entry.seq)
        self.peer_out.append((entry.prefill_replica,
                              HandoffRelease(entry.seq.seq_id, False, error=why)))

    def refuse(self, rid: int) -> None:
        """An abort for a request not here yet: forget its queued offer, or refuse it later."""
        for msg in self.offers:
            if msg.request_id == rid:
                self.offers.remove(msg)
                return
        self.refused[rid] = None
        if len(self.refused) > MAX_REFUSED_IDS:
            self.refused.popitem(last=False)

    # ------------------------------------------------------------ both

    def owns(self, seq: Sequence) -> bool:
        """Whether this replica reports seq's end: prefill until released, decode after."""
        return self.role == "prefill" or seq.seq_id not in self.incoming

    def forget(self, seq: Sequence) -> None:
        """Take a HANDOFF sequence out of the hand-off (it is ending on this side)."""
        rid = seq.seq_id
        entry = self.end_out(rid)
        if entry is not None:
            self.peer_out.append((entry.decode_replica, HandoffCancel(rid)))
            if entry.exported:
                self.exported_ended[rid] = entry.num_moved
                if len(self.exported_ended) > MAX_REFUSED_IDS:
                    self.exported_ended.popitem(last=False)
        elif seq in self.landed:
            self.landed.remove(seq)

    def drop(self, seq: Sequence) -> None:
        """Decode side: forget an unlanded hand-off silently (the prefill replica reports
        the request's end); frames still to come are dropped by the ranks."""
        entry = self.incoming.pop(seq.seq_id)
        if entry.accept_sent_s is not None:
            self.worker_out.append(KVCancel([seq.seq_id]))
        self.state.block_manager.free(seq)
        seq.status = FINISHED
        del self.seqs[seq.seq_id]
        self.client_keys.pop(seq.seq_id, None)
        self.admit_offers()

    def admitted(self, seq: Sequence) -> None:
        """A landed sequence becomes one of the scheduler's own (step_planner)."""
        state = self.state
        del self.seqs[seq.seq_id]
        seq.client = state.waiting.client(self.client_keys.pop(seq.seq_id, ""))
        seq.client.running += 1
        state.seqs[seq.seq_id] = seq
        state.deltas.continued_ids.append(seq.seq_id)  # before any row of it, on this link

    def on_cancel(self, msg: HandoffCancel) -> None:
        seq = self.seqs.get(msg.request_id)
        if seq is None:
            if self.role == "decode" and msg.request_id not in self.state.seqs:
                self.refuse(msg.request_id)
        elif msg.request_id in self.incoming:
            self.drop(seq)
        elif self.role == "prefill":
            self.fail(seq, "the decode replica gave the hand-off up")

    def tick(self) -> None:
        """Admit queued offers, send the accepts that became safe, give up on transfers
        past their time."""
        self.admit_offers()
        state, now = self.state, time.monotonic()
        oldest = state.inflight[0].step_id if state.inflight else None
        for entry in list(self.incoming.values()):
            if entry.accept_sent_s is None and (oldest is None or oldest > entry.after_step):
                entry.accept_sent_s = now
                seq = entry.seq
                dest = seq.block_table[entry.reused:]
                self.peer_out.append((entry.prefill_replica, HandoffAccept(
                    seq.seq_id, self.replica, dest, entry.reused)))
                if not dest:  # every block held here already: nothing to move
                    self._landed(entry)
        self._expire(now)

    def _expire(self, now: float) -> None:
        for entry in list(self.incoming.values()):
            if entry.accept_sent_s is not None and now - entry.accept_sent_s > self.timeout_s:
                self.give_up(entry, f"KV transfer from prefill replica {entry.prefill_replica} "
                             f"did not land on decode replica {self.replica} within "
                             f"{self.timeout_s:g} s")
        for entry in list(self.out.values()):
            if entry.dest is not None and now - entry.accepted_s > 2 * self.timeout_s:
                self.fail(entry.seq, f"decode replica {entry.decode_replica} did not take the "
                          f"KV within {2 * self.timeout_s:g} s")
