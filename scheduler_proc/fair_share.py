"""Fair sharing between clients: who is admitted next, and whose sequence gives way.

Every request carries a client key (AddRequest.client_key: one per client connection, or the
name an HTTP caller gives). The rule, by sequences (slots), not by tokens:

- Admission: the next slot goes to the waiting client that holds the fewest running
  sequences; among equals, to the one served least recently (round robin). Within a
  client, first come first served, a preempted sequence first.
- Room: when every slot is taken, a waiting client holding at least two fewer sequences
  than the largest client takes one slot from it: the largest client's most recently
  admitted sequence is preempted (one per step).
- Pool pressure: when a running sequence cannot grow, the sequence preempted is the most
  recently admitted one of the client holding the most, among the growing one and those
  the step has not planned yet (else the newest overall).

One client alone sees exactly the old behaviour: one FIFO, the newest preempted first.
Each admission costs O(waiting clients); a preemption O(clients) plus a scan back from the
tail of the running list to the largest client's newest sequence.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator

from scheduler_proc.sequence import Client, Sequence


class WaitingQueues:
    """The waiting sequences of every client, and the clients with unfinished sequences.

    Iterating yields every waiting sequence (client by client, in turn order)."""

    __slots__ = ("clients", "_turns", "_len")

    def __init__(self) -> None:
        self.clients: dict[str, Client] = {}
        """Every client with an unfinished sequence, by key."""
        self._turns: OrderedDict[str, Client] = OrderedDict()
        """Clients with waiting sequences, the one served least recently first."""
        self._len = 0

    def client(self, key: str) -> Client:
        """The client of this key, made on its first request."""
        c = self.clients.get(key)
        if c is None:
            c = self.clients[key] = Client(key)
        return c

    def forget_if_idle(self, c: Client) -> None:
        """Drop a client with nothing waiting or running (its key may come back later)."""
        if c.running == 0 and not c.waiting:
            self.clients.pop(c.key, None)

    def append(self, seq: Sequence) -> None:
        """Queue a new request at the back of its client's queue."""
        c = seq.client
        if not c.waiting:
            self._turns[c.key] = c
        c.waiting.append(seq)
        self._len += 1

    def appendleft(self, seq: Sequence) -> None:
        """Queue a preempted sequence at the front of its client's queue."""
        c = seq.client
        if not c.waiting:
            self._turns[c.key] = c
        c.waiting.appendleft(seq)
        self._len += 1

    def next_client(self) -> Client:
        """The client whose head is admitted next (there must be one): fewest running, then
        least recently served."""
        turns = self._turns
        if len(turns) == 1:
            return next(iter(turns.values()))
        best: Client | None = None
        for c in turns.values():
            if best is None or c.running < best.running:
                best = c
        assert best is not None
        return best

    def pop(self, c: Client) -> Sequence:
        """Take the head of `c`'s queue; `c` goes to the back of the turn order."""
        seq = c.waiting.popleft()
        self._len -= 1
        if c.waiting:
            self._turns.move_to_end(c.key)
        else:
            del self._turns[c.key]
        return seq

    def remove(self, seq: Sequence) -> None:
        """Take out a waiting sequence that finishes (aborted, or ended while preempted)."""
        c = seq.client
        c.waiting.remove(seq)
        self._len -= 1
        if not c.waiting:
            del self._turns[c.key]

    def clear(self) -> None:
        self.clients.clear()
        self._turns.clear()
        self._len = 0

    def largest(self) -> Client | None:
        """The client holding the most running sequences (None when none runs)."""
        best: Client | None = None
        for c in self.clients.values():
            if c.running and (best is None or c.running > best.running):
                best = c
        return best

    def needs_room(self, running: list[Sequence], max_seqs: int) -> int | None:
        """The Room rule: the index in `running` of the sequence to preempt so a waiting
        client gets its share of slots, or None when it is not owed one."""
        if len(running) < max_seqs or len(self.clients) < 2 or not self._turns:
            return None
        needy, donor = self.next_client(), self.largest()
        if donor is None or donor.running < needy.running + 2:
            return None
        if needy.waiting[0].num_pending:  # cannot be re-sent before its token arrives
            return None
        return newest_of(running, donor, 0)

    def __len__(self) -> int:
        return self._len

    def __bool__(self) -> bool:
        return self._len > 0

    def __iter__(self) -> Iterator[Sequence]:
        for c in self._turns.values():
            yield from c.waiting


def newest_of(running: list[Sequence], c: Client, start: int) -> int | None:
    """The index of `c`'s most recently admitted sequence in running[start:], if any."""
    for i in range(len(running) - 1, start - 1, -1):
        if running[i].client is c:
            return i
    return None


def pressure_victim(queues: WaitingQueues, running: list[Sequence], growing: Sequence) -> int:
    """The Pool pressure rule: the index of the sequence to preempt so that `growing` fits:
    the newest of the client holding the most among `growing` and the sequences after it
    (those before it are planned already), else the tail; the tail when one client runs."""
    last = len(running) - 1
    if len(queues.clients) < 2:
        return last
    donor = queues.largest()
    i = None if donor is None else newest_of(running, donor, running.index(growing))
    return last if i is None else i


class _Hole:
    """Stands in the running list for a sequence preempted while the planner walks it."""

    __slots__ = ()
    client = None


HOLE = _Hole()
