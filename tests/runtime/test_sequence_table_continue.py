"""A plan's continuing sequences in the worker's mirror: a decode step without new blocks
takes one lookup per sequence; new blocks, a failed sequence or an unknown one take the
checks of each, and both give the same entries."""

from __future__ import annotations

import numpy as np
import pytest

from gpu_workers.sequence_table import MirrorError, SequenceTable
from protocol import CachedSequences, NewSequence, SamplingParams, StepPlan


def decoding(n: int = 3) -> SequenceTable:
    table = SequenceTable(4, 64, 4, vocab_size=100, num_blocks=16, block_size=4)
    seqs = [NewSequence(i, [5, 6, 7, 8], 4, 0, 4, [i], SamplingParams()) for i in range(n)]
    table.apply(StepPlan(0, [], seqs, CachedSequences([], [], [])))
    table.num_computed[:n] = 3
    return table


def test_a_decode_step_without_blocks_continues_every_sequence_in_plan_order():
    table = decoding()
    ids, rows, num_new = table.apply(StepPlan(1, [], [], CachedSequences([2, 0, 1], [1] * 3,
                                                                         [[], [], []])))
    assert ids == [2, 0, 1]
    assert rows.tolist() == [table.rows[2], table.rows[0], table.rows[1]]
    assert num_new.tolist() == [1, 1, 1]


def test_new_blocks_are_appended_to_their_tables():
    table = decoding()
    table.num_tokens[table.rows[1]] = 5  # its fifth token needs a second block
    ids, rows, _ = table.apply(StepPlan(1, [], [], CachedSequences([0, 1], [1, 2],
                                                                   [[], [9]])))
    assert ids == [0, 1]
    row = table.rows[1]
    assert table.block_tables[row, :2].tolist() == [1, 9] and table.num_blocks[row] == 2


def test_a_failed_sequence_is_skipped_and_an_unknown_one_is_a_desync():
    table = decoding()
    bad = NewSequence(7, [5, 500], 2, 0, 2, [3], SamplingParams())  # 500: past the vocab
    ids, _, _ = table.apply(StepPlan(1, [], [bad], CachedSequences([0], [1], [[]])))
    assert ids == [0] and 7 in table.failed
    table.num_computed[table.rows[0]] = 3
    ids, _, _ = table.apply(StepPlan(2, [], [], CachedSequences([7, 0], [1, 1], [[], []])))
    assert ids == [0]  # planned before the scheduler heard of the failure
    with pytest.raises(MirrorError, match="unknown sequence 9"):
        table.apply(StepPlan(3, [], [], CachedSequences([9], [1], [[]])))


def test_mismatched_columns_are_refused():
    table = decoding()
    with pytest.raises(ValueError):
        table.apply(StepPlan(1, [], [], CachedSequences([0, 1], [1], [[], []])))
    assert np.all(table.num_computed[:3] == 3)


def test_a_block_refused_fails_its_sequence_alone_and_keeps_the_others_in_order():
    table = decoding()
    for sid in (0, 1, 2):
        table.num_tokens[table.rows[sid]] = 5  # each fifth token needs a second block
    ids, rows, _ = table.apply(StepPlan(1, [], [], CachedSequences([2, 1, 0], [2, 2, 2],
                                                                   [[9], [99], [10]])))
    assert ids == [2, 0]  # block 99 is outside the 16-block pool
    assert rows.tolist() == [table.rows[2], table.rows[0]]
    assert [sid for sid, _ in table.new_failures] == [1] and "outside" in table.failed[1]
    assert table.block_tables[table.rows[2], :2].tolist() == [2, 9]
    assert table.block_tables[table.rows[0], :2].tolist() == [0, 10]


@pytest.mark.parametrize(("params", "penalized", "plain", "inv"), [
    (SamplingParams(), False, True, 1.0),  # temperature 1, no filter
    (SamplingParams(temperature=0.5, seed=3), False, True, 2.0),
    (SamplingParams(temperature=0.7, top_p=0.9), False, False, np.float32(1) / np.float32(0.7)),
    (SamplingParams(temperature=0.0, top_k=5), False, True, 0.0),  # greedy: filters moot
    (SamplingParams(temperature=0.0, repetition_penalty=1.2), True, False, 0.0),
    (SamplingParams(temperature=1.0, logprobs=True), False, False, 1.0),
    (SamplingParams(temperature=0.0, logprobs=True, top_logprobs=2), False, False, 0.0),
])
def test_a_rows_sampling_needs_are_derived_when_it_is_added(params, penalized, plain, inv):
    table = SequenceTable(2, 16, 4, vocab_size=100, num_blocks=16, block_size=4)
    table.apply(StepPlan(0, [], [NewSequence(5, [1, 2], 2, 0, 2, [0], params)],
                         CachedSequences([], [], [])))
    row = table.rows[5]
    assert bool(table.uses_penalties(np.array([row]))[0]) is penalized
    assert bool(table.plain_draw[row]) is plain
    assert table.inv_temperature[row] == np.float32(inv)
