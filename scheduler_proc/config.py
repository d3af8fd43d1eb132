"""Scheduler process configuration."""

from __future__ import annotations

from dataclasses import dataclass, field

from protocol.limits import (
    MAX_NUM_BATCHED_TOKENS,
    MAX_NUM_SEQS,
    plans_ahead_conflict,
    plans_in_flight,
)


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """Limits the scheduler plans within.

    `num_kv_blocks` is what the workers found room for at start-up (it comes back in their
    READY message), so this config is built after the handshake rather than mutated.
    The pipeline builds it with EngineConfig.scheduler_config; the defaults here are the
    shared ones of protocol/limits.py, for configs built by hand.
    """

    num_kv_blocks: int
    block_size: int
    max_num_seqs: int = MAX_NUM_SEQS
    max_num_batched_tokens: int = MAX_NUM_BATCHED_TOKENS["cpu"]
    max_model_len: int = field(kw_only=True)  # required; keyword-only as it follows defaults
    enable_prefix_caching: bool = True
    overlap: bool = True
    plans_ahead: int = 1
    """With overlap: steps planned ahead of the results. How many plans may be in flight, and
    when the deepest one is made, is one rule: scheduler_proc.plans_in_flight."""
    deep_plan_max_seqs: int | None = None
    """With plans_ahead 2: the deepest plan is made only while at most this many sequences
    run, all decoding and none waiting, and the host paces (scheduler_proc.plans_in_flight);
    None: whenever there is room."""
    result_spin_s: float = 0.0
    """How long the step loop polls without sleeping while a step's result is due. On a GPU
    host this takes the wake-up off the chain that paces small-batch decoding; on a CPU
    run it would take a core from the workers' compute, so it stays 0 there."""
    num_host_slots: int = 0
    """Blocks of the host KV tier (what the workers found room for; 0: no tier)."""
    host_block_bytes: int = 0
    """Bytes one host-tier block takes over all the ranks (only the stats use it)."""
    swap_min_tokens: int | None = None
    """With a host tier, preemption swaps a sequence out only past this many computed tokens
    (None: one block); shorter ones are recomputed (scheduler_proc.swap)."""
    num_speculative_tokens: int = 0
    """Speculation: proposals a decoding entry may verify per step (0: off). Works with
    overlap: a plan sent before the previous result sizes blocks and length caps as if every
    proposal in flight is accepted (step_planner)."""
    role: str = ""
    """Prefill/decode disaggregation (scheduler_proc.handoff): "prefill", "decode", or ""
    for a replica that serves whole requests."""
    replica: int = 0
    """This replica's index, as the router and the other replicas name it."""
    handoff_ranks: int = 1
    """Ranks whose KV must land before a handed-off request runs (the tensor-parallel size)."""
    transfer_timeout_s: float = 30.0
    """A hand-off not landed this long after its blocks were offered fails its request."""
    max_transfer_blocks: int = 0
    """Most blocks a prefill replica exports at once (0: a quarter of the pool)."""

    def __post_init__(self) -> None:
        for name in (
            "num_kv_blocks",
            "block_size",
            "max_num_seqs",
            "max_num_batched_tokens",
            "max_model_len",
            "plans_ahead",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"SchedulerConfig.{name} must be a positive int, got {value!r}")

        if not 0.0 <= self.result_spin_s <= 1.0:
            raise ValueError("SchedulerConfig.result_spin_s must be in [0, 1] seconds, "
                             f"got {self.result_spin_s!r}")
        if self.deep_plan_max_seqs is not None and self.deep_plan_max_seqs < 0:
            raise ValueError("SchedulerConfig.deep_plan_max_seqs must be >= 0 or None, "
                             f"got {self.deep_plan_max_seqs!r}")
        if self.swap_min_tokens is not None and self.swap_min_tokens < 0:
            raise ValueError("SchedulerConfig.swap_min_tokens must be >= 0 or None, "
                             f"got {self.swap_min_tokens!r}")
        if self.num_speculative_tokens < 0:
            raise ValueError("SchedulerConfig.num_speculative_tokens must be >= 0")
        why = plans_ahead_conflict(self.plans_ahead, speculative=self.num_speculative_tokens > 0,
                                   overlap=self.overlap)
        if why is not None:
            raise ValueError(f"SchedulerConfig.plans_ahead {why}")

    @property
    def max_plans_in_flight(self) -> int:
        return plans_in_flight(self.overlap, self.plans_ahead)

    @property
    def kv_capacity_tokens(self) -> int:
        return self.num_kv_blocks * self.block_size

    def check_pool_fits_model_len(self) -> None:
        """Refuse to serve when one max_model_len sequence cannot fit in the whole KV pool.

        Such a pool would leave long requests waiting forever; saying so at start-up tells the
        operator what to change instead.
        """
        if self.kv_capacity_tokens < self.max_model_len:
            raise ValueError(
                f"the KV cache holds {self.kv_capacity_tokens} tokens "
                f"({self.num_kv_blocks} blocks x {self.block_size}) but max_model_len is "
                f"{self.max_model_len}: lower max_model_len or give the KV cache more memory"
            )
