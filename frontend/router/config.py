"""What the router knows of the replicas it places requests on."""

from __future__ import annotations

from dataclasses import dataclass

ROUTING_POLICIES = ("affinity", "round_robin")


@dataclass(frozen=True)
class RouterConfig:
    scheduler_addresses: tuple[str, ...]
    """Each replica's scheduler input (AddRequest, AbortRequests), replica i at index i."""
    stats_addresses: tuple[str, ...]
    """Each replica's `deltas_pub`, where its scheduler publishes EngineStats."""
    block_size: int
    """The replicas' KV block size: the router hashes prompts in the same blocks."""
    kv_blocks: tuple[int, ...]
    """KV blocks of each replica: its prefix summary never remembers more blocks."""
    routing: str = "affinity"
    enable_prefix_caching: bool = True
    roles: tuple[str, ...] = ()
    """Prefill/decode disaggregation: each replica's role ("prefill" or "decode"); empty when
    every replica serves whole requests. New requests go to prefill replicas; each also gets
    a decode replica (frontend.router.decode_choice)."""

    def __post_init__(self) -> None:
        n = len(self.scheduler_addresses)
        if n < 1 or len(self.stats_addresses) != n or len(self.kv_blocks) != n:
            raise ValueError("RouterConfig needs one scheduler, stats address and KV size "
                             "per replica")
        if self.roles and len(self.roles) != n:
            raise ValueError("RouterConfig.roles needs one role per replica")
        if self.routing not in ROUTING_POLICIES:
            raise ValueError(f"RouterConfig.routing must be one of {ROUTING_POLICIES}, "
                             f"got {self.routing!r}")

    @property
    def num_replicas(self) -> int:
        return len(self.scheduler_addresses)
