"""A tiny test-only planner: makes StepPlans the way a scheduler would, with no prefix cache
logic of its own (tests pass shared block tables explicitly)."""

from __future__ import annotations

from dataclasses import dataclass, field

from protocol import CachedSequences, NewSequence, SamplingParams, StepPlan


@dataclass
class PlannedSeq:
    seq_id: int
    prompt: list[int]
    params: SamplingParams
    max_tokens: int
    blocks: list[int] = field(default_factory=list)
    output: list[int] = field(default_factory=list)
    num_computed: int = 0
    sent: bool = False

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output

    @property
    def done(self) -> bool:
        return len(self.output) >= self.max_tokens


class Planner:
    def __init__(self, block_size: int, num_blocks: int) -> None:
        self.block_size = block_size
        self.next_block = 0
        self.num_blocks = num_blocks
        self.step_id = 0
        self.seqs: dict[int, PlannedSeq] = {}
        self.pending_drops: list[int] = []

    def add(self, seq_id: int, prompt: list[int], max_tokens: int,
            params: SamplingParams | None = None, shared_blocks: list[int] | None = None,
            num_cached: int = 0) -> PlannedSeq:
        seq = PlannedSeq(seq_id, list(prompt), params or SamplingParams(temperature=0.0),
                         max_tokens, blocks=list(shared_blocks or []), num_computed=num_cached)
        self.seqs[seq_id] = seq
        return seq

    def _ensure_blocks(self, seq: PlannedSeq, upto: int) -> list[int]:
        new = []
        while len(seq.blocks) * self.block_size < upto:
            assert self.next_block < self.num_blocks, "test planner ran out of blocks"
            new.append(self.next_block)
            seq.blocks.append(self.next_block)
            self.next_block += 1
        return new

    def preempt(self, seq_id: int) -> None:
        """Forget the sequence's KV (keep its tokens); it is re-sent in full next time."""
        seq = self.seqs[seq_id]
        seq.sent = False
        seq.num_computed = 0
        seq.blocks = []
        self.pending_drops.append(seq_id)

    def plan(self, chunks: dict[int, int] | None = None) -> StepPlan | None:
        """One step for every unfinished sequence; chunks caps num_new per sequence."""
        chunks = chunks or {}
        new_seqs, c_ids, c_new, c_blocks = [], [], [], []
        self.planned: list[tuple[PlannedSeq, int]] = []
        for seq in self.seqs.values():
            if seq.done:
                continue
            todo = len(seq.tokens) - seq.num_computed
            n = min(todo, chunks.get(seq.seq_id, todo))
            if n <= 0:
                continue
            if not seq.sent:
                self._ensure_blocks(seq, seq.num_computed + n)
                new_seqs.append(NewSequence(seq.seq_id, seq.tokens, len(seq.prompt),
                                            seq.num_computed, n, list(seq.blocks), seq.params))
                seq.sent = True
            else:
                c_ids.append(seq.seq_id)
                c_new.append(n)
                c_blocks.append(self._ensure_blocks(seq, seq.num_computed + n))
            self.planned.append((seq, n))
        if not self.planned and not self.pending_drops:
            return None
        plan = StepPlan(self.step_id, self.pending_drops, new_seqs,
                        CachedSequences(c_ids, c_new, c_blocks))
        self.pending_drops = []
        self.step_id += 1
        return plan

    def apply(self, result) -> None:
        sampled = dict(zip(result.seq_ids, result.token_ids, strict=True))
        for seq, n in self.planned:
            seq.num_computed += n
            expect = seq.num_computed == len(seq.tokens)
            assert (seq.seq_id in sampled) == expect, (seq.seq_id, expect)
            if expect:
                seq.output.append(sampled[seq.seq_id])
        for sid in [s.seq_id for s in self.seqs.values() if s.done and s.sent]:
            self.seqs[sid].sent = False
            self.pending_drops.append(sid)

    def run(self, runner, max_steps: int = 10_000) -> dict[int, list[int]]:
        for _ in range(max_steps):
            plan = self.plan()
            if plan is None:
                break
            self.apply(runner.execute(plan))
        return {sid: s.output for sid, s in self.seqs.items()}
