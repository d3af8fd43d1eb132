"""Choosing the decode replica of a request (prefill/decode disaggregation), at placement.

The choice travels in the AddRequest (decode_replica), so the prefill replica knows at once
where to offer the request when its first token is out, and the router knows both replicas
that hold it (aborts go to both; the death of either goes to the other, which fails it or
serves on, router.dispatch). With no decode replica alive a request gets none and is served
whole by its prefill replica. Chosen by the lightest load:
running + waiting + hand-offs in flight to it per its last EngineStats, plus what was sent
its way since, weighted against its free KV blocks (a decode replica with fewer free blocks
makes offers queue); ties go in turn.
"""

from __future__ import annotations

from protocol.engine_messages import EngineStats


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

    def choose(self, alive: list[bool]) -> int:
        """A live decode replica; -1 when none is (the request is served whole by its
        prefill replica)."""
        live = [r for r in self.replicas if alive[r]]
        if not live:
            return -1
        self._turn += 1
        order = live[self._turn % len(live):] + live[:self._turn % len(live)]
        best = min(order, key=self._cost)
        self.sent_since_stats[best] += 1
        return best

    def _cost(self, replica: int) -> float:
        s = self.stats.get(replica)
        queued = self.sent_since_stats[replica]
        if s is None:
            return float(queued)
        free = max(0, s.kv_blocks_total - s.kv_blocks_used) / max(1, s.kv_blocks_total)
        return (s.running + s.waiting + s.kv_handoffs_in_waiting + queued) / (0.05 + free)
