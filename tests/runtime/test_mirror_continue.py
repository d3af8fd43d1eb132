"""A plan's continuing sequences in the worker's mirror: a decode step without new blocks
takes one lookup per sequence; new blocks, a failed sequence or an unknown one take the
checks of each, and both give the same entries."""

from __future__ import annotations

import numpy as np
import pytest

from gpu_workers.mirror import MirrorError, SequenceTable
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
