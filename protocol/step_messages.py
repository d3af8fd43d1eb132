"""Messages of one engine step: scheduler -> workers -> scheduler -> detokenizers.

Sequences are delta-encoded: a worker gets a sequence in full once (NewSequence) and
afterwards only what it cannot know (CachedSequences), so a continuing decode sequence
costs a few bytes per step whatever its length.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field

from protocol.codec import message, struct
from protocol.metrics import RequestMetrics
from protocol.outcomes import FinishReason, RequestError
from protocol.packed_ints import int32_array
from protocol.sampling_params import SamplingParams

OUT_OF_BAND_STEP = -1
"""TokenDeltas.step_id of deltas that no step produced (admission errors, aborts, failures)."""


@struct
@dataclass(frozen=True, slots=True)
class NewSequence:
    """A sequence the workers do not mirror yet, or one resumed after preemption."""

    seq_id: int
    token_ids: array
    """Every known token: the prompt plus, after preemption, all tokens generated so far."""
    num_prompt_tokens: int
    num_computed: int
    """Tokens whose KV is already in the cache (a prefix-cache hit)."""
    num_new: int
    """Tokens to compute this step, starting at num_computed."""
    block_table: array
    params: SamplingParams
    """Usually one object for many sequences: the codec sends and checks it once per plan."""

    def __post_init__(self) -> None:
        # A prefill plan is mostly these two columns: int32 arrays, packed on the wire. Any
        # iterable of ints is accepted here.
        if (values := int32_array(self.token_ids)) is not self.token_ids:
            object.__setattr__(self, "token_ids", values)
        if (values := int32_array(self.block_table)) is not self.block_table:
            object.__setattr__(self, "block_table", values)


@struct
@dataclass(frozen=True, slots=True)
class CachedSequences:
    """Column-oriented deltas for sequences the workers already mirror.

    A worker advances its own computed count by num_new each step and appends each token
    it samples, so neither the context nor the last token is ever re-sent.
    """

    seq_ids: list[int]
    num_new: list[int]
    new_block_ids: list[list[int]]
    """Blocks appended to each sequence's block table this step (mostly empty)."""
    num_spec: list[int] = field(default_factory=list)
    """Speculation: the most proposed tokens each entry may verify after its num_new (the
    scheduler reserved their KV slots and token budget); empty when no entry speculates."""


@struct
@dataclass(frozen=True, slots=True)
class BlockMoves:
    """Host-tier copies a step's workers make before its forward (same on every rank: each
    copies its own shard). Stores run first, so a slot may be stored and a device block it
    came from be reused by the same step's loads."""

    store_device_blocks: list[int] = field(default_factory=list)
    store_host_slots: list[int] = field(default_factory=list)
    """Device block store_device_blocks[i] goes to host slot store_host_slots[i]."""
    load_host_slots: list[int] = field(default_factory=list)
    load_device_blocks: list[int] = field(default_factory=list)
    """Host slot load_host_slots[i] comes back into device block load_device_blocks[i]."""

    def __bool__(self) -> bool:
        return bool(self.store_device_blocks or self.load_host_slots)


NO_MOVES = BlockMoves()


@message(0x20)
@dataclass(frozen=True, slots=True)
class StepPlan:
    """One step for every rank. Workers apply drop_seq_ids, then the trims, then new_seqs,
    then cached.

    An entry samples a token iff it reaches the end of the sequence's known tokens.
    """

    step_id: int
    drop_seq_ids: list[int]
    """Finished, aborted or preempted sequences: workers forget their mirrors."""
    new_seqs: list[NewSequence]
    cached: CachedSequences
    trim_seq_ids: list[int] = field(default_factory=list)
    """Speculation: sequences whose block tables the scheduler cut since its last plan
    (blocks reserved for proposals that were rejected). Sparse: empty on most steps."""
    trim_num_blocks: list[int] = field(default_factory=list)
    """The length each of those tables is cut to, before this plan's new blocks are appended.
    The scheduler never cuts a block that a plan already sent may still write."""
    moves: BlockMoves = NO_MOVES
    """Host-tier stores and loads, done before this step's forward (mostly empty)."""


@message(0x21)
@dataclass(frozen=True, slots=True)
class StepResult:
    """Rank 0's answer to a plan: the tokens sampled for each entry that sampled.

    One token per entry, unless num_tokens is set (speculation): then entry i produced
    num_tokens[i] tokens (its accepted proposals, then one sampled token), flattened in
    token_ids, and logprobs / top alternatives follow the same flat order."""

    step_id: int
    seq_ids: list[int]
    token_ids: list[int]
    logprobs: list[float] | None
    top_token_ids: list[list[int]] | None = None
    """Per entry, the most likely tokens (as many as the step's widest request asked for)."""
    top_logprobs: list[list[float]] | None = None
    failed_seq_ids: list[int] = field(default_factory=list)
    """Sequences the workers refused to run (contents that do not fit them). They are left out
    of seq_ids, here and in later steps, until a plan drops them; the scheduler fails their
    requests. Every rank refuses the same ones: the checks depend only on the plan."""
    failed_errors: list[str] = field(default_factory=list)
    """Why, one message per failed sequence."""
    num_tokens: list[int] | None = None
    """Speculation: tokens each entry produced (1 + accepted proposals)."""
    num_proposed: list[int] | None = None
    """Speculation: tokens each entry verified (proposals made, accepted or not); None when
    no entry verified any (a list of zeros is stored as None: 1 byte per entry saved)."""
    gpu_busy_s: float = 0.0
    """Device time of the forward and sample of this and earlier steps whose time was not
    reported yet (read without a sync, so it may lag a step); the sum over results is the
    engine's GPU busy time."""
    ended_seq_ids: list[int] = field(default_factory=list)
    """Sequences that ran but whose requests must end here with an error, their token in
    this result not kept: a structured output whose grammar allows no next token. Unlike
    the failed ones they stay in seq_ids; later plans drop them as for any finish."""
    ended_errors: list[str] = field(default_factory=list)
    """Why, one message per ended sequence."""

    def __post_init__(self) -> None:
        if self.num_proposed is not None and not any(self.num_proposed):
            object.__setattr__(self, "num_proposed", None)


@message(0x22)
@dataclass(frozen=True, slots=True)
class TokenDeltas:
    """What one step added to each request; finish_reasons[i] is None while it runs."""

    step_id: int
    """The step that produced these tokens, or OUT_OF_BAND_STEP."""
    request_ids: list[int]
    token_ids: list[list[int]]
    finish_reasons: list[FinishReason | None]
    errors: list[RequestError | None]
    """Set (with finish reason ERROR) for a request that failed."""
    logprobs: list[list[float]] | None
    top_token_ids: list[list[list[int]]] | None = None
    """Per request, per token: the most likely tokens (when any request asked for them)."""
    top_logprobs: list[list[list[float]]] | None = None
    metrics_ids: list[int] = field(default_factory=list)
    """The requests of this message that finished in the scheduler, a sparse column beside
    the others: only a finish carries metrics."""
    metrics: list[RequestMetrics] = field(default_factory=list)
    """Their metrics, in the order of metrics_ids."""
    handoff_ids: list[int] = field(default_factory=list)
    """Prefill/decode disaggregation, prefill side: requests whose rows here are the last of
    this replica's; their streams go on from a decode replica."""
    continued_ids: list[int] = field(default_factory=list)
    """Decode side: requests whose streams go on from here, after their prefill replica's
    hand-off rows. Streams of two replicas reach the detokenizer on two links, so their order
    is not given: it holds these requests' rows until the hand-off rows have arrived."""

    def columns_agree(self) -> bool:
        """Whether every per-row column has a row for each request (a frame that does not
        is malformed)."""
        n = len(self.request_ids)
        top_ids, top_lps = self.top_token_ids, self.top_logprobs
        return (len(self.token_ids) == len(self.finish_reasons) == len(self.errors) == n
                and len(self.metrics_ids) == len(self.metrics)
                and (self.logprobs is None or len(self.logprobs) == n)
                and (top_ids is None or (top_lps is not None
                                         and len(top_ids) == len(top_lps) == n)))
