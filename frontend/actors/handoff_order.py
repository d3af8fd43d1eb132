"""Order of a disaggregated request's rows at the detokenizer.

A request's first token comes from its prefill replica, the rest from its decode replica:
two schedulers, two links into the detokenizer, so nothing orders them. The decode replica
marks the moment a request's stream goes on there (TokenDeltas.continued_ids, before any of
its rows), the prefill replica marks its last rows (TokenDeltas.handoff_ids). A request
continued before its hand-off rows arrived has its rows held until they do, or until the
decode replica says they never will (an empty hand-off row: the prefill replica died).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

Row = tuple[Any, ...]
"""The detokenizer's arguments for one row: (request_id, token_ids, finish, error, ...)."""


class HandoffOrder:
    def __init__(self) -> None:
        self._handed_off: set[int] = set()
        """Requests whose hand-off rows came before their continuation mark (the usual)."""
        self._held: dict[int, list[Row]] = {}

    def continued(self, request_ids: Iterable[int]) -> None:
        """Decode replicas' marks: hold the rows of those not handed off yet."""
        for rid in request_ids:
            if rid in self._handed_off:
                self._handed_off.discard(rid)
            else:
                self._held.setdefault(rid, [])

    def rows(self, row: Row, is_handoff: bool) -> list[Row]:
        """The rows to apply now, in order, given `row` just arrived."""
        rid, finish, error = row[0], row[2], row[3]
        held = self._held.get(rid)
        if error is not None:  # a failure ends the request wherever its rows are
            self._forget(rid)
            return [row]
        if is_handoff:
            # An empty one is a decode replica's word that the prefill replica died: its
            # last rows came or never will (scheduler_proc.handoff_faults).
            shown = [row] if row[1] or finish is not None else []
            if held is None:
                self._handed_off.add(rid)
                return shown
            del self._held[rid]
            return [*shown, *held]
        if held is not None:
            held.append(row)
            return []
        if finish is not None:
            self._forget(rid)
        return [row]

    def _forget(self, rid: int) -> None:
        self._handed_off.discard(rid)
        self._held.pop(rid, None)

    def __len__(self) -> int:
        """Requests with something remembered here (tests: nothing is left behind)."""
        return len(self._handed_off) + len(self._held)
