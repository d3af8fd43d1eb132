"""The worker's mirror refuses one sequence, and the scheduler fails that request alone.

The worker here is the real SequenceTable, fed each plan through the wire codec (token ids
arrive packed as int32), with a stand-in model (it samples last token + 1), so the contract
between the two is what runs: refusal, skipping the continuations planned
before the scheduler heard of it (overlap), the drop that ends it, and the freed blocks.
"""

from __future__ import annotations

import numpy as np
import pytest

from gpu_workers.sequence_table import SequenceTable
from protocol import (
    AddRequest,
    CachedSequences,
    Decoder,
    ErrorKind,
    FinishReason,
    NewSequence,
    RequestError,
    SamplingParams,
    StepPlan,
    StepResult,
    TokenDeltas,
    encode,
)
from scheduler_proc import Scheduler, SchedulerConfig

VOCAB, BLOCKS, BLOCK_SIZE = 50, 32, 4
PARAMS = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
WIRE = Decoder(StepPlan)


class MirrorWorker:
    def __init__(self) -> None:
        self.table = SequenceTable(4, 128, 16, vocab_size=VOCAB, num_blocks=BLOCKS,
                                   block_size=BLOCK_SIZE)

    def execute(self, plan: StepPlan) -> StepResult:
        t = self.table
        plan = WIRE.decode(encode(plan))  # as a worker gets it: token ids packed as int32
        ids, rows, new = t.apply(plan)
        end = t.num_computed[rows] + new
        t.num_computed[rows] = end
        samples = np.flatnonzero(end == t.num_tokens[rows])
        srows = rows[samples]
        tokens = (t.tokens[srows, t.num_tokens[srows] - 1].astype(np.int64) + 1) % VOCAB
        pos, epochs = t.append_placeholders(srows)
        t.fill_tokens(srows, pos, epochs, tokens)
        return StepResult(plan.step_id, [ids[i] for i in samples], tokens.tolist(), None,
                          failed_seq_ids=[sid for sid, _ in t.new_failures],
                          failed_errors=[err for _, err in t.new_failures])


def run(requests: list[AddRequest], overlap: bool) -> tuple[dict, dict, Scheduler, MirrorWorker]:
    sched = Scheduler(SchedulerConfig(BLOCKS, BLOCK_SIZE, max_model_len=64, overlap=overlap))
    worker = MirrorWorker()
    for req in requests:
        sched.add_request(req)
    tokens: dict[int, list[int]] = {}
    outcome: dict[int, tuple[FinishReason, RequestError | None]] = {}

    def collect(deltas: TokenDeltas | None) -> None:
        if deltas is None:
            return
        for rid, toks, fin, err in zip(deltas.request_ids, deltas.token_ids,
                                       deltas.finish_reasons, deltas.errors, strict=True):
            tokens.setdefault(rid, []).extend(toks)
            if fin is not None:
                outcome[rid] = (fin, err)

    in_flight: list[StepResult] = []
    for _ in range(100):
        plan = sched.schedule()
        if plan is not None:
            in_flight.append(worker.execute(plan))
        if in_flight and (plan is None or not overlap or len(in_flight) == 2):
            collect(sched.process_result(in_flight.pop(0)))
            sched.check_integrity()
        if not in_flight and plan is None and not sched.has_unfinished():
            break
    worker.execute(StepPlan(999, sched.state.drops, [], CachedSequences([], [], [])))
    return tokens, outcome, sched, worker


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("bad_prompt, why", [
    ([1, VOCAB + 3, 2], "outside the vocabulary"), ([4, 2**31 - 1], "outside the vocabulary"),
    ([-1, 3], "outside the vocabulary"), ([-(2**31), 3], "outside the vocabulary"),
])
def test_a_refused_sequence_fails_its_request_alone(overlap, bad_prompt, why):
    good = [AddRequest(1, [1, 2, 3, 4, 5, 6], PARAMS, []),
            AddRequest(3, [10, 11], PARAMS, [])]
    tokens, outcome, sched, worker = run(
        [good[0], AddRequest(2, bad_prompt, PARAMS, []), good[1]], overlap)
    assert outcome[2][0] is FinishReason.ERROR and why in outcome[2][1].message
    assert outcome[2][1].kind is ErrorKind.REQUEST_FAILED
    assert tokens[2] == []
    assert tokens[1] == [7, 8, 9, 10, 11] and outcome[1] == (FinishReason.LENGTH, None)
    assert tokens[3] == [12, 13, 14, 15, 16] and outcome[3] == (FinishReason.LENGTH, None)
    assert sched.block_manager.num_free == BLOCKS  # its blocks came back
    assert not worker.table.failed and not worker.table.rows  # the drop reached the mirror


def test_the_mirror_refuses_what_its_columns_cannot_hold():
    table = SequenceTable(2, 32, 4, vocab_size=VOCAB, num_blocks=BLOCKS, block_size=BLOCK_SIZE)
    forged = SamplingParams()
    object.__setattr__(forged, "top_k", 2**31)
    cases = {
        1: NewSequence(1, [1, 2], 2, 0, 2, [0], forged),
        2: NewSequence(2, [1, 2], 2, 0, 2, [BLOCKS], PARAMS),  # a block outside the pool
        3: NewSequence(3, [1] * 9, 9, 0, 9, [0, 1], PARAMS),  # blocks hold 8 tokens, not 9
        4: NewSequence(4, [1] * 40, 40, 0, 40, [0], PARAMS),  # longer than the mirror's rows
        5: NewSequence(5, [1, 2], 2, 0, 2, [2], PARAMS),  # fine
    }
    ids, rows, _ = table.apply(StepPlan(0, [], list(cases.values()),
                                        CachedSequences([], [], [])))
    assert ids == [5] and list(table.rows) == [5]
    reasons = dict(table.new_failures)
    assert sorted(reasons) == [1, 2, 3, 4]
    assert "column" in reasons[1] and "KV pool" in reasons[2] and "9 tokens" in reasons[3]
    # Continuations planned before the scheduler heard are skipped, not a desync...
    ids, _, _ = table.apply(StepPlan(1, [], [], CachedSequences([1, 5], [1, 1], [[], []])))
    assert ids == [5] and table.new_failures == []
    # ...and a new block outside the pool fails a running sequence the same way.
    ids, _, _ = table.apply(StepPlan(2, [1, 2, 3, 4], [],
                                     CachedSequences([5], [1], [[BLOCKS + 7]])))
    assert ids == [] and dict(table.new_failures).keys() == {5}
    assert list(table.failed) == [5] and not table.rows
