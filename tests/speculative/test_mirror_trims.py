"""The worker's mirror cuts block tables only where a plan says (StepPlan.trim_seq_ids), before
that plan's new blocks; a verification step never cuts them on its own."""

from __future__ import annotations

import numpy as np
import pytest

from gpu_workers.sequence_table import MirrorError, SequenceTable
from protocol import CachedSequences, NewSequence, SamplingParams, StepPlan

BS = 4


def table_with_one_sequence() -> SequenceTable:
    table = SequenceTable(4, 64, 16, vocab_size=100, num_blocks=32, block_size=BS)
    # 6 prompt tokens, blocks for 12 positions (room for proposals).
    table.apply(StepPlan(0, [], [NewSequence(1, list(range(10, 16)), 6, 0, 6, [3, 4, 5],
                                             SamplingParams())], CachedSequences([], [], [])))
    table.num_computed[table.rows[1]] += 6  # what launching the step does
    return table


def blocks(table: SequenceTable, sid: int) -> list[int]:
    row = table.rows[sid]
    return table.block_tables[row, :int(table.num_blocks[row])].tolist()


def test_verification_keeps_the_table_and_the_plan_cuts_it_before_new_blocks():
    table = table_with_one_sequence()
    row = np.array([table.rows[1]])
    table.append_placeholders(row)  # the prefill's token: 7 tokens, 6 computed
    table.fill_tokens(row, np.array([6]), table.epoch[row].copy(), np.array([41]))
    table.append_verified(row, np.array([1]), np.array([42]))  # a step that accepted nothing
    assert blocks(table, 1) == [3, 4, 5]  # a later plan may still write block 5
    table.apply(StepPlan(2, [], [], CachedSequences([1], [1], [[9]]), [1], [2]))
    assert blocks(table, 1) == [3, 4, 9]


@pytest.mark.parametrize("sid, keep, why", [(7, 1, "unknown sequence"),
                                            (1, 4, "above its table"),
                                            (1, 1, "below its 6 computed")])
def test_a_trim_that_contradicts_the_mirror_is_a_desync(sid, keep, why):
    table = table_with_one_sequence()
    with pytest.raises(MirrorError, match=why.split()[-1]):
        table.apply(StepPlan(1, [], [], CachedSequences([], [], []), [sid], [keep]))


def test_a_refused_sequence_is_not_trimmed():
    table = table_with_one_sequence()
    table.apply(StepPlan(1, [], [], CachedSequences([1], [1], [[99]])))  # 99: outside the pool
    assert 1 in table.failed
    table.apply(StepPlan(2, [], [], CachedSequences([], [], []), [1], [2]))  # ignored
