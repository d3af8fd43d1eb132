"""Choosing the decode replica of a request (prefill/decode disaggregation), at placement.

The choice travels in the AddRequest (decode_replica), so the prefill replica knows at once
where to offer the request when its first token is out, and the router knows both replicas
that hold it (aborts go to both; the death of either goes to the other, which fails it or
serves on, router.dispatch). With no decode replica alive a request gets none and is served
whole by its prefill replica.

Load: running + waiting + hand-offs in flight to it per its last EngineStats, plus what was
sent its way since, weighted against its free KV blocks (a decode replica with fewer free
blocks makes offers queue). Among the replicas within BUSIER_BY of the lightest load, the one
that was given the most of the prompt's leading blocks wins (with affinity routing: the next
turn of a conversation goes where the earlier turns were decoded, and that replica takes
those blocks from its prefix cache instead of receiving them); then the lighter; ties go in
turn.
"""

from __future__ import annotations

from collections.abc import Sequence

from frontend.router.prefix_summary import PrefixSummary
from protocol.engine_messages import EngineStats

BUSIER_BY = 2.0
"""How much more loaded (times the lightest load, plus one request) a decode replica that
holds more of the prompt may be and still be chosen for it."""


class DecodeChooser:
    def __init__(self, roles: tuple[str, ...]) -> None:
        self.replicas = [r for r, role in enumerate(roles) if role == "decode"]
        self.stats: dict[int, EngineStats] = {}
        self.sent_since_stats = dict.fromkeys(self.replicas, 0)
        self._turn = 0

    def on_stats(self, replica: int, stats: EngineStats) -> None:
        if replica in self.sent_since_stats:
            self.stats[replica] = stats
            self.sent_since_stats[replica] = 0

    def choose(self, alive: list[bool], hashes: Sequence[int] = (),
               summaries: Sequence[PrefixSummary] = ()) -> int:
        """A live decode replica; -1 when none is (the request is served whole by its
        prefill replica). `hashes`: the prompt's block hashes, `summaries`: what each replica
        was given (the router's, indexed by replica); the choice is remembered there."""
        live = [r for r in self.replicas if alive[r]]
        if not live:
            return -1
        self._turn += 1
        order = live[self._turn % len(live):] + live[:self._turn % len(live)]
        cost = {r: self._cost(r) for r in order}
        near = [r for r in order if cost[r] <= BUSIER_BY * min(cost.values()) + 1]
        held = {r: summaries[r].matched_blocks(hashes) if hashes else 0 for r in near}
        best = max(near, key=lambda r: (held[r], -cost[r]))
        self.sent_since_stats[best] += 1
        if hashes:
            summaries[best].add(hashes)
        return best

    def _cost(self, replica: int) -> float:
        s = self.stats.get(replica)
        queued = self.sent_since_stats[replica]
        if s is None:
            return float(queued)
        free = max(0, s.kv_blocks_total - s.kv_blocks_used) / max(1, s.kv_blocks_total)
        return (s.running + s.waiting + s.kv_handoffs_in_waiting + queued) / (0.05 + free)
