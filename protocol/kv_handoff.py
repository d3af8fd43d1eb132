"""Prefill/decode disaggregation: the hand-off of a request and its KV blocks between replicas.

A prefill replica's scheduler computes a prompt and its first token, then offers the request
to the decode replica the router chose (HandoffOffer). The decode scheduler allocates blocks
for it and answers with their ids (HandoffAccept). The prefill scheduler tells its ranks to
export the source blocks (KVExport, on the plan stream, so it runs after the plans that wrote
them); rank i sends them to the decode replica's rank i as raw frames (KVFrameHeader, then the
tensor bytes); each decode rank scatters them and reports KVLanded to its scheduler. When all
ranks have landed the decode scheduler runs the request and releases the prefill replica's
blocks (HandoffRelease). Either side may give the hand-off up (HandoffCancel); KVCancel tells
a decode replica's ranks to drop frames still to come for a request whose blocks are freed.
When a replica dies, the router tells the other role's replicas which requests it shared with
them (HandoffPeerDown).

Ownership, which decides who reports a request's end: the prefill replica until the decode
replica says the KV landed (HandoffRelease with landed=True), the decode replica after.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field

from protocol.codec import message, struct
from protocol.packed_ints import int32_array
from protocol.sampling_params import SamplingParams


@message(0x50)
@dataclass(frozen=True, slots=True)
class HandoffOffer:
    """Prefill scheduler -> decode scheduler: a request whose prompt KV is ready to move."""

    request_id: int
    prefill_replica: int
    """Where to answer (the index of the offering replica)."""
    token_ids: array
    """Prompt and generated tokens so far (the first token, sampled by the prefill replica)."""
    num_prompt_tokens: int
    num_computed: int
    """Tokens whose KV the blocks hold (the prompt): the decode replica computes from here."""
    params: SamplingParams
    """Resolved (max_tokens concrete). Penalties count the tokens above, so no other state
    travels; a seeded sampler is keyed by the request's seed and position, not a stream."""
    eos_token_ids: list[int]
    arrival_time: float
    """Wall clock of the request's arrival, for its metrics."""
    queue_time_s: float
    ttft_s: float
    """Arrival -> first scheduled and -> first token, as the prefill replica measured them."""
    cached_prompt_tokens: int
    host_prompt_tokens: int
    preemptions: int
    num_blocks: int
    client_key: str = ""
    """Whose share the request counts against on the decode replica too (fair sharing)."""

    def __post_init__(self) -> None:
        if (values := int32_array(self.token_ids)) is not self.token_ids:
            object.__setattr__(self, "token_ids", values)


@message(0x51)
@dataclass(frozen=True, slots=True)
class HandoffAccept:
    """Decode scheduler -> prefill scheduler: the blocks the KV goes to, allocated and safe to
    write (no plan that the decode replica sent earlier still touches them)."""

    request_id: int
    decode_replica: int
    block_ids: list[int]
    """Destinations of the offer's blocks after the reused ones, in order."""
    reused_blocks: int = 0
    """Leading blocks of the offer the decode replica holds already (its prefix cache): not
    transferred. With every block reused the release follows at once."""


@message(0x52)
@dataclass(frozen=True, slots=True)
class HandoffRelease:
    """Decode scheduler -> prefill scheduler: the hand-off is over; free the source blocks.
    landed: the decode replica now owns the request. Otherwise it failed there (`error` says
    why) and the prefill replica fails the request."""

    request_id: int
    landed: bool
    num_bytes: int = 0
    """KV bytes received over all ranks."""
    transfer_s: float = 0.0
    """Accept sent -> every rank landed, on the decode replica's clock."""
    error: str = ""


@message(0x53)
@dataclass(frozen=True, slots=True)
class HandoffCancel:
    """Either scheduler -> the other: forget this hand-off and free its blocks, reporting
    nothing (the request ended, or the sender gave the hand-off up and reports it)."""

    request_id: int


@message(0x54)
@dataclass(frozen=True, slots=True)
class KVExport:
    """Scheduler -> its ranks, ordered with the plans: send these blocks to decode replica
    `decode_replica`'s rank of the same index, into `dest_block_ids` (same order)."""

    request_id: int
    block_ids: list[int]
    decode_replica: int
    dest_block_ids: list[int]


@message(0x55)
@dataclass(frozen=True, slots=True)
class KVCancel:
    """Decode scheduler -> its ranks, ordered with the plans: drop frames still to come for
    these requests (their blocks are freed and may be reused by the plans after this)."""

    request_ids: list[int]


@message(0x56)
@dataclass(frozen=True, slots=True)
class KVLanded:
    """Decode rank -> its scheduler: a request's blocks are in its pool (ok), or its frames
    were refused (error says why)."""

    request_id: int
    rank: int
    num_bytes: int
    ok: bool = True
    error: str = ""


@message(0x57)
@dataclass(frozen=True, slots=True)
class KVFrameHeader:
    """The first frame of a transfer chunk; the second is the gathered blocks' raw bytes,
    [2, layers, len(dest_block_ids), block_size, kv_heads, head_dim] of `dtype`, C order."""

    request_id: int
    dest_block_ids: list[int]
    dtype: str
    shape: list[int]
    last: bool
    """The request's last chunk: the receiver reports KVLanded after it."""


@message(0x58)
@dataclass(frozen=True, slots=True)
class HandoffPeerDown:
    """Router -> a live scheduler of the other role: replica `replica` died (`reason`), and
    `request_ids` were paired with it. The requests this replica owns go on; it ends the
    others with an error naming the dead replica. A decode replica frees what it holds for
    them (and drops the dead replica's later offers); a prefill replica serves the ones it
    has not offered yet whole."""

    replica: int
    reason: str
    request_ids: list[int]


@struct
@dataclass(frozen=True, slots=True)
class CudaPoolHandle:
    """A CUDA KV pool's storage as torch describes it for another process on this host
    (the fields of `UntypedStorage._share_cuda_()`, opened by `_new_shared_cuda`), and the
    GPU it is on."""

    device: int
    handle: bytes
    size_bytes: int
    offset_bytes: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes
    event_sync_required: bool
    device_uuid: str = ""
    """The GPU's UUID: `device` is an index into the prefill process's visible GPUs, which
    another process may number otherwise."""


@message(0x59)
@dataclass(frozen=True, slots=True)
class KVPoolShare:
    """Prefill rank -> decode rank of the same index, the first message on their transfer link
    when KV moves through shared pools (--kv-transfer shared): where the decode rank maps the
    prefill rank's pool from. On CUDA the IPC handle (`cuda`); on the CPU the memfd holding
    it, which the decode rank opens as /proc/`pid`/fd/`fd`."""

    prefill_replica: int
    dtype: str
    shape: list[int]
    """The pool's shape: [2, layers, blocks, block_size, kv_heads, head_dim]."""
    pid: int
    fd: int
    """The memfd's descriptor in process `pid` (-1 on CUDA)."""
    cuda: CudaPoolHandle | None = None


@message(0x5A)
@dataclass(frozen=True, slots=True)
class KVBlocksReady:
    """Prefill rank -> decode rank (shared pools): `block_ids` of the prefill rank's pool hold
    the request's KV (every step that wrote them is done). The decode rank copies them into
    `dest_block_ids` and reports KVLanded once the copy is done; the prefill replica keeps the
    blocks until the hand-off is released."""

    request_id: int
    prefill_replica: int
    block_ids: list[int]
    dest_block_ids: list[int]


KV_TRANSFER_MODES = ("frames", "shared")
"""How KV blocks move: raw ZeroMQ frames through host memory, or copies out of the prefill
rank's pool mapped into the decode rank (gpu_workers.kv_shared_pool)."""


@dataclass(frozen=True)
class KVLinks:
    """What a replica's processes need to take part in hand-offs (sent in their start spec).

    Indexed by replica: `peer_schedulers[r]` is replica r's scheduler input ("" for one of the
    same role), `transfer[r]` replica r's transfer address for this rank ("" unless decode)."""

    role: str = ""
    """"prefill" or "decode" ("" serves whole requests: colocated, or --dp)."""
    replica: int = 0
    peer_schedulers: tuple[str, ...] = ()
    transfer: tuple[str, ...] = field(default=())
    mode: str = "frames"
    """One of KV_TRANSFER_MODES."""
