"""Messages from the frontend to the scheduler, from the tokenizer to the detokenizer, and
from the scheduler to the detokenizers that attach to its `deltas_pub` socket (Watch*) and
to anyone who follows the engine's counters there (EngineStats)."""

from __future__ import annotations

import dataclasses
from array import array
from dataclasses import dataclass, field

import msgpack

from protocol.codec import kind_of, message
from protocol.metrics import RequestMetrics
from protocol.outcomes import FinishReason
from protocol.packed_ints import int32_array
from protocol.sampling_params import SamplingParams


@message(0x10)
@dataclass(frozen=True, slots=True)
class AddRequest:
    request_id: int
    """Assigned by the tokenizer; also the sequence id in the scheduler and the workers."""
    prompt_token_ids: array
    """Checked against the vocabulary by the tokenizer; packed int32 on the wire (any
    iterable of ints is accepted here)."""
    params: SamplingParams
    eos_token_ids: list[int]
    client_request_id: str = ""
    """The client's own id of the request, for attached detokenizers to show ("" when the
    request was made inside the engine, as benchmarks do)."""
    arrival_time: float = 0.0
    """Wall clock (time.time()) when the tokenizer received the request; 0 when it was made
    inside the engine (the scheduler then counts from its own receipt)."""
    client_key: str = ""
    """Whose share of the engine this request counts against (scheduler_proc.fair_share):
    the tokenizer's number for the client connection, plus the name the client gave, if
    any ("3" or "3/alice"). Requests made inside the engine share the key ""."""
    decode_replica: int = -1
    """Prefill/decode disaggregation: the decode replica the router chose for this request
    (protocol.kv_handoff); -1 when the receiving replica serves it whole."""

    def __post_init__(self) -> None:
        if (values := int32_array(self.prompt_token_ids)) is not self.prompt_token_ids:
            object.__setattr__(self, "prompt_token_ids", values)


@message(0x11)
@dataclass(frozen=True, slots=True)
class AbortRequests:
    request_ids: list[int]
    reason: FinishReason
    """ABORT (the client gave up) or STOP (the detokenizer matched a stop string)."""


@message(0x12)
@dataclass(frozen=True, slots=True)
class DetokRequestInfo:
    """Everything the detokenizer needs to decode a request and route it to its client."""

    request_id: int
    client_id: str
    client_request_id: str
    prompt_tail_token_ids: list[int]
    """The last prompt tokens: decoding starts after them so the first word is spaced right."""
    num_prompt_tokens: int
    stop: list[str]
    skip_special_tokens: bool
    stream: bool
    logprobs: bool
    top_logprobs: int = 0
    """How many alternatives of each token to pass on (the step may carry more)."""
    include_stop: bool = False
    """Keep the stop string that ended the request at the end of its text."""


# ---------------------------------------------------------------- scheduler -> watchers
# The scheduler publishes TokenDeltas on `deltas_pub` for detokenizers that attach to a running
# pipeline (python -m frontend.actors.stdout_detokenizer). These messages make attaching and
# detaching deterministic: a PUB socket gives a subscriber no sign that it has joined, nor
# that the publisher has gone.


@message(0x40)
@dataclass(frozen=True, slots=True)
class WatchHeartbeat:
    """Sent to every new subscriber as soon as its subscription arrives (it is attached from
    then on), and to all every `interval_s`: a watcher that hears nothing for a few intervals
    knows the pipeline is gone."""

    interval_s: float
    dead_reason: str | None
    """Set once the engine is dead, so a watcher that attaches afterwards learns it at once."""


@message(0x41)
@dataclass(frozen=True, slots=True)
class WatchRequest:
    """A request the scheduler accepted; published before any of its TokenDeltas (and again to
    a new subscriber for each request still running)."""

    request_id: int
    client_request_id: str
    stop: list[str] = field(default_factory=list)
    """The request's stop strings: a watcher cuts its text where the client's is cut."""
    include_stop: bool = False


@message(0x42)
@dataclass(frozen=True, slots=True)
class WatchGoodbye:
    """The last message: the scheduler is stopping (engine_dead False) or the engine died."""

    reason: str
    engine_dead: bool


@message(0x43)
@dataclass(frozen=True, slots=True)
class EngineStats:
    """The scheduler's counters, published every STATS_INTERVAL_S (and with each heartbeat), and
    when a step finishes requests at most once per FRESH_STATS_GAP_S; never per step. Counters
    only grow, so a subscriber gets rates from the difference of any two messages (divided by
    the difference of their `time_s`); gauges are the state now.

    Fields are read without stopping the step loop, so one message may be a step ahead in one
    counter and not in another: fine for rates, not an invariant to check.
    """

    time_s: float
    """The scheduler's time.monotonic() when it took the counters."""
    steps: int
    """Plans sent to the workers."""
    prompt_tokens: int
    """Prefill tokens computed: prompts, and what a resumed sequence recomputes after
    preemption; cached tokens not included."""
    cached_prompt_tokens: int
    """Prefill tokens served from the prefix cache instead (hit rate: cached / (cached +
    computed))."""
    generated_tokens: int
    """Tokens sampled and kept (overlap's discarded extra tokens are not counted)."""
    preemptions: int
    finished_requests: int
    """Requests finished for any reason (stop, length, abort, error)."""
    schedule_time_s: float
    """Scheduler time spent planning steps."""
    result_time_s: float
    """Scheduler time spent applying the steps' results."""
    running: int
    waiting: int
    kv_blocks_used: int
    kv_blocks_total: int
    spec_proposed_tokens: int = 0
    """Speculation: proposed tokens verified (acceptance rate: accepted / proposed)."""
    spec_accepted_tokens: int = 0
    """Speculation: proposed tokens the target model accepted."""
    gpu_busy_s: float = 0.0
    """Device time of the steps' forward and sample as the workers measured it (rank 0); over
    an interval, 1 - busy / elapsed is the share the GPU sat idle."""
    steps_two_ahead: int = 0
    """Plans made while two others were in flight (plans_ahead 2: the host's chain hidden)."""
    finished_by_reason: list[int] = field(default_factory=list)
    """Cumulative finished requests per FinishReason (index = its value)."""
    finished: list[RequestMetrics] = field(default_factory=list)
    """The metrics of each request finished since the previous EngineStats (each goes out
    once, so a subscriber that misses a message misses those records; the counters above
    stay exact)."""
    host_hit_tokens: int = 0
    """Of cached_prompt_tokens, those loaded from the host KV tier."""
    host_blocks_stored: int = 0
    """KV blocks copied device -> host (each block is kv bytes per token x block_size)."""
    host_blocks_loaded: int = 0
    """KV blocks copied host -> device."""
    host_blocks_used: int = 0
    host_blocks_total: int = 0
    """The host tier's size in blocks (0: no tier)."""
    host_swaps_out: int = 0
    """Preempted sequences swapped out to the host tier instead of recomputed (their blocks
    count in host_blocks_stored)."""
    host_swaps_in: int = 0
    """Swapped sequences resumed with their KV loaded back (blocks in host_blocks_loaded)."""
    host_block_bytes: int = 0
    """Bytes one host-tier block takes over all the ranks: blocks x this = bytes moved."""
    kv_handoffs_out: int = 0
    """Disaggregation, a prefill replica: requests whose KV a decode replica took."""
    kv_handoffs_in: int = 0
    """A decode replica: requests whose KV landed here."""
    kv_handoff_failures: int = 0
    """Hand-offs given up (timeout, refused frames); their requests failed."""
    kv_transfer_blocks_out: int = 0
    kv_transfer_bytes_out: int = 0
    kv_transfer_blocks_in: int = 0
    kv_transfer_bytes_in: int = 0
    kv_transfer_s: float = 0.0
    """A decode replica: transfer time summed over the hand-offs in (accept -> landed)."""
    kv_handoffs_out_waiting: int = 0
    """Gauge, prefill: hand-offs offered or exporting, not released yet."""
    kv_handoffs_in_waiting: int = 0
    """Gauge, decode: offers waiting for blocks, or blocks waiting for their KV."""
    kv_handoff_blocks_reused: int = 0
    """Decode: blocks of handed-off requests found in this replica's prefix cache, so not
    transferred."""


def _topic(cls: type) -> bytes:
    n = len(dataclasses.fields(cls))
    head = msgpack.packb([kind_of(cls), *([None] * n)])
    return head[: len(head) - n]  # each None packs as one byte


ENGINE_STATS_TOPIC = _topic(EngineStats)
"""How every encoded EngineStats begins (its msgpack array header, then its kind): the
subscription prefix of a subscriber that wants only the stats."""
