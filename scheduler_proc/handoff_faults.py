"""A replica of the other role died: what this replica does with the requests it shared.

The router names them (HandoffPeerDown); this replica decides, because only it knows which
of them it owns (scheduler_proc.handoff: the prefill replica until the KV landed, the decode
replica after).

Decode side, its prefill replica died: a request whose KV landed here goes on untouched (it
no longer needs the prefill replica); one still prefilling there, offered or in transfer
ends with the error, and its blocks here are freed (frames still on their way are dropped).
A request that goes on gets an empty row marked as its hand-off (TokenDeltas.handoff_ids):
should the prefill replica's own last rows have died with it, the detokenizer holds no row
of it waiting for them (frontend.actors.handoff_order).

Prefill side, its decode replica died: a request not offered yet, or offered but not yet
exported, is served whole here (its KV is here and none of it left), as if it had been given
no decode replica; one exported ends with the error, freeing its blocks (its KV may have
landed there, and the stream gone on from it before the release came back); one the decode
replica owned (unknown here) ends with the error too.

When the engine itself dies, fail_all ends every hand-off this side owns.

Nothing is recomputed. The error is the router's for every request a replica's death fails
("engine dead: replica R: why"), so the client reads the same words wherever it was failed;
an id that already finished gets a second end, which the detokenizer drops.
"""

from __future__ import annotations

from protocol import ErrorKind, FinishReason, RequestError
from protocol.kv_handoff import HandoffPeerDown
from scheduler_proc.handoff import Handoffs
from scheduler_proc.sequence import Sequence

ERROR = FinishReason.ERROR


def peer_error(msg: HandoffPeerDown) -> RequestError:
    return RequestError(ErrorKind.ENGINE_DEAD, f"engine dead: replica {msg.replica}: "
                        f"{msg.reason}")


def on_peer_down(handoffs: Handoffs, msg: HandoffPeerDown) -> None:
    """End the requests shared with the dead replica that this one does not own."""
    error = peer_error(msg)
    handoffs.dead_peers[msg.replica] = error
    if handoffs.role == "decode":
        failed = _prefill_lost(handoffs, msg)
    else:
        failed = _decode_lost(handoffs, msg, error)
    deltas = handoffs.state.deltas
    for rid in failed:
        deltas.add(rid, [], ERROR, error)


def fail_all(handoffs: Handoffs, error: RequestError) -> None:
    """The engine is dead: end every hand-off this side owns with `error`, forget the rest."""
    handoffs.offers.clear()
    for seq in list(handoffs.seqs.values()):
        if handoffs.owns(seq):
            handoffs.end(seq, ERROR, error)
        else:
            handoffs.drop(seq)


def _prefill_lost(handoffs: Handoffs, msg: HandoffPeerDown) -> list[int]:
    dead, deltas = msg.replica, handoffs.state.deltas
    failed = dict.fromkeys(rid for rid in msg.request_ids if not _owned(handoffs, rid))
    for rid in msg.request_ids:
        if rid not in failed:  # its prefill part is over: rows waiting for it may go on
            deltas.add(rid, [], None, None)
            deltas.handoff_ids.append(rid)
    for entry in list(handoffs.incoming.values()):  # whatever the router named or not
        if entry.prefill_replica == dead:
            failed[entry.seq.seq_id] = None
    for offer in list(handoffs.offers):
        if offer.prefill_replica == dead:
            handoffs.offers.remove(offer)
            failed[offer.request_id] = None
    for rid in failed:
        entry = handoffs.incoming.get(rid)
        if entry is not None:
            handoffs.counters.failures += 1
            handoffs.drop(entry.seq)  # KVCancel for frames on their way, blocks freed
    return list(failed)


def _owned(handoffs: Handoffs, rid: int) -> bool:
    """Decode side: running here, or landed and waiting for admission."""
    if rid in handoffs.state.seqs:
        return True
    seq = handoffs.seqs.get(rid)
    return seq is not None and rid not in handoffs.incoming


def _decode_lost(handoffs: Handoffs, msg: HandoffPeerDown, error: RequestError) -> list[int]:
    state, dead = handoffs.state, msg.replica
    failed: list[int] = []
    for seq in state.seqs.values():  # not offered yet: served whole here
        if seq.decode_replica == dead:
            seq.decode_replica = -1
    for rid in msg.request_ids:
        if rid not in state.seqs and rid not in handoffs.seqs:
            failed.append(rid)  # the decode replica owned it (or it finished)
    for entry in list(handoffs.out.values()):
        if entry.decode_replica != dead:
            continue
        if entry.exported:  # its KV may have landed there, and its stream gone on
            handoffs.counters.failures += 1
            handoffs.end(entry.seq, ERROR, error)
        else:  # none of its KV left: it decodes here
            _take_back(handoffs, entry.seq)
    return failed


def _take_back(handoffs: Handoffs, seq: Sequence) -> None:
    """Decode an unexported offer here after all (its decode replica died), as landed."""
    handoffs.end_out(seq.seq_id)
    seq.decode_replica = -1
    handoffs.client_keys[seq.seq_id] = seq.client.key
    handoffs.landed.append(seq)
