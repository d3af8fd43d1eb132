"""Placing one request: on the live replica where it costs the least work.

Cost of replica r = tokens r must prefill for this request (its prompt less the leading
blocks r was already given, see prefix_summary) + LOAD_WEIGHT x the work already ahead of
it there. The work ahead is estimated from what the router placed and what the replica's
last EngineStats says it has done: prefill tokens placed (less the prefix each request was
expected to find cached) but not yet computed, plus REQUEST_COST per request placed but not
yet finished; a replica whose KV pool is nearly full costs KV_FULL_COST more (it would
preempt). Placing a request counts at
once, so a burst spreads before the next stats arrive (every half second, and within a few
milliseconds of a step that finishes requests: the scheduler sends fresh ones then).

LOAD_WEIGHT < 1 lets a prefix hit win over a slightly lighter replica: the request that
brought the prefix there is counted as load, yet the work it does is the work this request
reuses. Ties go to the replicas in turn. `round_robin` ignores both and takes them in turn.
"""

from __future__ import annotations

from dataclasses import dataclass

from frontend.router.config import RouterConfig
from frontend.router.prefix_summary import PrefixSummary, block_hashes
from protocol.engine_messages import EngineStats

LOAD_WEIGHT = 0.5
REQUEST_COST = 32
"""Tokens of work one unfinished request is counted as (its decode steps, roughly)."""
KV_FULL = 0.95
KV_FULL_COST = 1 << 20


@dataclass
class ReplicaLoad:
    """What the router placed on one replica, and the latest stats it published."""

    placed_requests: int = 0
    placed_prompt_tokens: int = 0
    """Prefill tokens placed here that no earlier request placed here had in its prefix."""
    stats: EngineStats | None = None

    def work_ahead(self) -> float:
        done_tokens = finished = 0
        kv_used = 0.0
        if self.stats is not None:
            s = self.stats
            done_tokens = s.prompt_tokens
            finished = s.finished_requests
            kv_used = s.kv_blocks_used / s.kv_blocks_total if s.kv_blocks_total else 0.0
        work = (max(0, self.placed_prompt_tokens - done_tokens)
                + REQUEST_COST * max(0, self.placed_requests - finished))
        return work + (KV_FULL_COST if kv_used >= KV_FULL else 0)


@dataclass(frozen=True, slots=True)
class Placement:
    replica: int
    matched_tokens: int
    """Prompt tokens the chosen replica was already given (its likely prefix-cache hit)."""
    hashes: tuple[int, ...] = ()
    """The prompt's full-block hashes (affinity routing with the prefix cache on)."""


class Router:
    """Chooses a replica per request; knows which replicas are alive."""

    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        n = config.num_replicas
        self.loads = [ReplicaLoad() for _ in range(n)]
        self.summaries = [PrefixSummary(blocks) for blocks in config.kv_blocks]
        self.alive = [True] * n
        self._turn = 0
        self.decisions = 0

    @property
    def live_replicas(self) -> list[int]:
        return [r for r in range(len(self.alive)) if self.alive[r]]

    @property
    def placeable(self) -> bool:
        """Whether some live replica takes new requests."""
        return bool(self._placeable())

    def _placeable(self) -> list[int]:
        """Live replicas that take new requests (with disaggregation, the prefill ones)."""
        roles = self.config.roles
        return [r for r in self.live_replicas if not roles or roles[r] == "prefill"]

    def place(self, token_ids: list[int]) -> Placement:
        """The replica for a prompt, recorded as placed there. Raises LookupError when no
        replica is alive."""
        live = self._placeable()
        if not live:
            raise LookupError("no data-parallel replica is alive")
        self.decisions += 1
        if len(self.alive) == 1:  # one engine: nothing to choose, nothing to hash
            return Placement(0, 0)
        start = self._turn % len(live)
        self._turn += 1
        order = live[start:] + live[:start]
        affinity = self.config.routing == "affinity"
        hashes = (block_hashes(token_ids, self.config.block_size)
                  if affinity and self.config.enable_prefix_caching else [])
        best, best_cost, best_matched = order[0], float("inf"), 0
        if affinity:
            for r in order:
                matched = self.summaries[r].matched_blocks(hashes) * self.config.block_size
                cost = len(token_ids) - matched + LOAD_WEIGHT * self.loads[r].work_ahead()
                if cost < best_cost:
                    best, best_cost, best_matched = r, cost, matched
        load = self.loads[best]
        load.placed_requests += 1
        load.placed_prompt_tokens += len(token_ids) - best_matched
        if hashes:
            self.summaries[best].add(hashes)
        return Placement(best, best_matched, tuple(hashes))

    def on_stats(self, replica: int, stats: EngineStats) -> None:
        load = self.loads[replica]
        if load.stats is not None and stats.time_s <= load.stats.time_s:
            return
        load.stats = stats
        if (stats.running == stats.waiting == 0
                and stats.finished_requests >= load.placed_requests):
            # Idle with everything placed finished: what it never prefilled (aborted while
            # waiting) is no work ahead, so the estimate starts again from its counters.
            load.placed_prompt_tokens = stats.prompt_tokens

    def mark_dead(self, replica: int) -> None:
        self.alive[replica] = False
        self.summaries[replica].clear()
