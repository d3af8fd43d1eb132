"""What one replica remembers of each hand-off in flight (scheduler_proc.handoff)."""

from __future__ import annotations

from dataclasses import dataclass, field

from protocol.kv_handoff import HandoffOffer
from scheduler_proc.sequence import Sequence, SequenceStatus


def offered_sequence(msg: HandoffOffer, max_model_len: int) -> Sequence:
    """Decode side: the sequence an offer carries, in a hand-off (no blocks yet), with the
    timings and counts its metrics go on from."""
    seq = Sequence(msg.request_id, msg.token_ids[:msg.num_prompt_tokens], msg.params,
                   msg.eos_token_ids, msg.arrival_time, max_model_len)
    seq.token_ids.extend(msg.token_ids[msg.num_prompt_tokens:])
    seq.num_computed = msg.num_computed
    seq.status = SequenceStatus.HANDOFF
    seq.first_scheduled_s = seq.arrival_s + msg.queue_time_s
    seq.first_token_s = seq.last_token_s = seq.arrival_s + msg.ttft_s
    seq.num_cached_prompt = msg.cached_prompt_tokens
    seq.num_host_prompt = msg.host_prompt_tokens
    seq.num_preemptions = msg.preemptions
    return seq


@dataclass(slots=True)
class OutEntry:
    """Prefill side: a sequence offered to a decode replica."""

    seq: Sequence
    decode_replica: int
    num_blocks: int
    dest: list[int] | None = None
    reused: int = 0
    """Leading blocks the decode replica holds already: not exported."""
    accepted_s: float = 0.0
    exported: bool = False

    @property
    def num_moved(self) -> int:
        return self.num_blocks - self.reused


@dataclass(slots=True)
class InEntry:
    """Decode side: blocks allocated for an offer, waiting for its KV on every rank."""

    seq: Sequence
    prefill_replica: int
    after_step: int
    """The last plan sent before the blocks were allocated: the accept waits for its result."""
    accept_sent_s: float | None = None
    ranks: set[int] = field(default_factory=set)
    num_bytes: int = 0
    reused: int = 0
    """Leading blocks found in this replica's prefix cache: not transferred."""


@dataclass(slots=True)
class HandoffCounters:
    """Cumulative, for EngineStats' kv_* fields."""

    handoffs_out: int = 0
    handoffs_in: int = 0
    failures: int = 0
    blocks_out: int = 0
    bytes_out: int = 0
    blocks_in: int = 0
    bytes_in: int = 0
    blocks_reused: int = 0
    transfer_s: float = 0.0

    def count_out(self, num_blocks: int, num_bytes: int) -> None:
        self.handoffs_out += 1
        self.blocks_out += num_blocks
        self.bytes_out += num_bytes

    def stats_fields(self, role: str, waiting: int) -> dict[str, int | float]:
        """EngineStats.kv_* fields; `waiting` is the gauge of the replica's role."""
        gauge = "kv_handoffs_out_waiting" if role == "prefill" else "kv_handoffs_in_waiting"
        return {"kv_handoffs_out": self.handoffs_out, "kv_handoffs_in": self.handoffs_in,
                "kv_handoff_failures": self.failures, "kv_transfer_blocks_out": self.blocks_out,
                "kv_transfer_bytes_out": self.bytes_out, "kv_transfer_blocks_in": self.blocks_in,
                "kv_transfer_bytes_in": self.bytes_in, "kv_transfer_s": self.transfer_s,
                "kv_handoff_blocks_reused": self.blocks_reused, gauge: waiting}
