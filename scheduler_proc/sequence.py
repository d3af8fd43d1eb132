"""A request as the scheduler tracks it (request id == sequence id), and the client whose share
it counts against."""

from __future__ import annotations

import enum
import sys
import time
from array import array
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from protocol.packed_ints import int32_array

if TYPE_CHECKING:
    from protocol import FinishReason, SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = 0
    RUNNING = 1
    FINISHED = 2
    HANDOFF = 3
    """Prefill/decode disaggregation: holding blocks between replicas (scheduler_proc.handoff)."""


class Sequence:
    """Scheduler-side truth about one sequence.

    Token accounting, with overlap in mind:
      token_ids      every token the scheduler knows (prompt + generated).
      num_pending    tokens the workers have sampled (or will sample in a plan already sent)
                     that the scheduler has not seen yet. Workers hold them in their mirror.
      num_computed   tokens whose KV is written by plans already sent, as far as known: +n at
                     schedule time, + the accepted proposals when a speculative result arrives.
      spec_inflight  proposals that plans in flight may verify; each accepted one adds a token
                     to both the worker-side length and its computed count.
    The worker-side length of a sequence is `len(token_ids) + num_pending` (+ up to
    spec_inflight); a step samples for a sequence iff it brings num_computed up to that length.
    Accepted proposals move both counts alike, so `length - computed` is exact even while their
    number is unknown: a plan sent before a speculative result still says n = 1.
    """

    __slots__ = (
        "seq_id",
        "prompt_ids",
        "token_ids",
        "num_prompt_tokens",
        "num_computed",
        "num_prefill",
        "num_pending",
        "block_table",
        "status",
        "finish_reason",
        "params",
        "stop_tokens",
        "max_tokens",
        "max_len",
        "on_worker",
        "num_hashed_blocks",
        "last_hash",
        "spec_inflight",
        "spec_proposed",
        "spec_accepted",
        "arrival_time",
        "arrival_s",
        "first_scheduled_s",
        "first_token_s",
        "last_token_s",
        "num_cached_prompt",
        "num_host_prompt",
        "num_preemptions",
        "decode_replica",
        "kv_transfer_s",
        "client",
    )

    def __init__(
        self,
        seq_id: int,
        prompt_token_ids: Iterable[int],
        params: SamplingParams,
        eos_token_ids: list[int] | tuple[int, ...] = (),
        arrival_time: float = 0.0,
        max_model_len: int | None = None,
    ) -> None:
        self.seq_id = seq_id
        # The prompt as it arrived, packed: a new sequence's plan entry sends it as it is.
        self.prompt_ids: array = int32_array(prompt_token_ids)
        self.token_ids: list[int] = self.prompt_ids.tolist()
        self.num_prompt_tokens = len(self.token_ids)
        self.num_computed = 0
        # Tokens known when last admitted: those below it are prefill (the prompt, or what a
        # resumed sequence recomputes), those after it are decoded. Only stats read it.
        self.num_prefill = 0
        self.num_pending = 0
        self.block_table: list[int] = []
        self.status = SequenceStatus.WAITING
        self.finish_reason: FinishReason | None = None
        self.params = params
        # Sampling one of these finishes it (STOP): EOS unless ignored on request, and the
        # request's stop token ids, which never are.
        eos = () if params.ignore_eos else eos_token_ids
        self.stop_tokens: frozenset[int] = frozenset((*eos, *params.stop_token_ids))
        self.max_tokens: int = params.max_tokens
        # Reaching this length finishes it (LENGTH): max_tokens generated, or max_model_len.
        max_len = sys.maxsize if max_model_len is None else max_model_len
        if self.max_tokens is not None:
            max_len = min(max_len, self.num_prompt_tokens + self.max_tokens)
        self.max_len: int = max_len
        # True while the workers hold a mirror of this sequence: later plans then send deltas,
        # and dropping it must be announced in drop_seq_ids.
        self.on_worker = False
        # Prefix-cache bookkeeping owned by the BlockManager: how many leading blocks of the
        # block table are hashed, and the chained hash of the last of them.
        self.num_hashed_blocks = 0
        self.last_hash = 0
        # Speculation: proposals that plans in flight let it verify (their KV slots are
        # reserved; how many get accepted is unknown until the results arrive), and proposals
        # verified and accepted over the request's life.
        self.spec_inflight = 0
        self.spec_proposed = 0
        self.spec_accepted = 0
        # Request metrics (scheduler_proc.stats.request_metrics): the arrival on the wall
        # clock and, once, on this process's monotonic clock, which times everything after.
        now, wall = time.monotonic(), time.time()
        self.arrival_time = arrival_time or wall
        self.arrival_s = now - max(0.0, wall - self.arrival_time)
        self.first_scheduled_s: float | None = None
        self.first_token_s: float | None = None
        self.last_token_s = 0.0
        self.num_cached_prompt = 0
        self.num_host_prompt = 0
        """Of num_cached_prompt, tokens loaded from the host KV tier."""
        self.num_preemptions = 0
        self.decode_replica = -1
        """A prefill replica's: where the sequence goes after its first token (-1: nowhere)."""
        self.kv_transfer_s: float | None = None
        self.client: Client | None = None
        """Whose share it counts against (scheduler_proc.fair_share); set on arrival."""

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_generated(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def generated_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def __repr__(self) -> str:
        return (
            f"Sequence(id={self.seq_id}, status={self.status.name}, tokens={len(self.token_ids)}, "
            f"computed={self.num_computed}, pending={self.num_pending}, "
            f"blocks={self.block_table})"
        )


@dataclass(slots=True, eq=False)
class Client:
    """One client's share: its waiting sequences (FIFO) and how many of its sequences run.
    Sequences point to it; scheduler_proc.fair_share keeps the clients and applies the rule."""

    key: str
    waiting: deque[Sequence] = field(default_factory=deque)
    running: int = 0
