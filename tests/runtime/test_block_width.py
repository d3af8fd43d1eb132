"""A step's block tables are as wide as its longest context needs, whatever max_model_len
allows: built, filled and copied at that width (a CUDA graph's inputs included, which its
graph widens on the device), growing with the context, and computing what a full-width
table does."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from random_prompts import random_prompts
from rt_helpers import BLOCK_SIZE, make_runner
from rt_planner import Planner

from gpu_workers.batch import build_batch
from gpu_workers.decode_graphs import input_capacities
from gpu_workers.sequence_table import SequenceTable
from gpu_workers.static_inputs import StaticInputs
from gpu_workers.token_layout import bucket_width
from kernels.widen_tables import widen_tables, widen_tables_ref
from protocol import CachedSequences, NewSequence, SamplingParams, StepPlan

CPU = torch.device("cpu")
HUGE = 131072
HUGE_WIDTH = HUGE // BLOCK_SIZE + 1  # WorkerConfig.max_blocks_per_seq with one plan ahead


def _huge_table(lens: list[int]) -> tuple[SequenceTable, np.ndarray, np.ndarray]:
    table = SequenceTable(8, HUGE + 2, HUGE_WIDTH, vocab_size=600, num_blocks=64,
                          block_size=BLOCK_SIZE)
    seqs, block = [], 0
    for i, n in enumerate(lens):
        nb = -(-(n + 1) // BLOCK_SIZE)
        seqs.append(NewSequence(i, [3 + i] * n, n, 0, n, list(range(block, block + nb)),
                                SamplingParams()))
        block += nb
    _, rows, num_new = table.apply(StepPlan(0, [], seqs, CachedSequences([], [], [])))
    return table, rows, num_new


def test_a_step_under_a_huge_limit_sends_tables_as_wide_as_its_contexts():
    table, rows, num_new = _huge_table([5, 40, 17])
    prefill = build_batch(table, rows, num_new, BLOCK_SIZE, CPU)
    assert prefill.attn.block_tables.shape == (3, 3)  # 40 tokens: 3 blocks of 16
    table.num_computed[rows] += num_new
    ones = np.ones(3, np.int64)
    decode = build_batch(table, rows, ones, BLOCK_SIZE, CPU, pad_to=4)
    assert decode.attn.block_tables.shape == (4, 3)
    # The longest grows to a block boundary, then past it: the width follows, one column more.
    longest = rows[1]
    table.tokens[longest, 41:49] = 9
    table.num_tokens[longest] = 49
    table.num_computed[longest] = 47
    assert build_batch(table, rows, ones, BLOCK_SIZE, CPU, pad_to=4).attn.block_tables.shape \
        == (4, 3)
    table._append_blocks(longest, [60])  # as a plan's new block for it would
    table.num_computed[longest] = 48
    grown = build_batch(table, rows, ones, BLOCK_SIZE, CPU, pad_to=4)
    assert grown.attn.block_tables.shape == (4, 4)
    assert grown.attn.block_tables[1].tolist() == [1, 2, 3, 60]


def test_a_graph_step_fills_and_copies_only_its_columns():
    """The compact tables are the last segment of a graph's inputs: the one copy stops where
    they end, so the rest of the max-width segment is neither written nor sent."""
    table, rows, num_new = _huge_table([5, 40, 17])
    table.num_computed[rows] += num_new
    inputs = StaticInputs(input_capacities(4, 1, HUGE_WIDTH), CPU, tail="tables")
    inputs.buffer.fill_(-7)  # what an earlier step (or nothing) left there
    batch = build_batch(table, rows, np.ones(3, np.int64), BLOCK_SIZE, CPU, pad_to=4,
                        into=inputs)
    assert batch.input_ids.data_ptr() == inputs.views["ids"].data_ptr()
    tables = inputs.views["tables"]
    assert batch.attn.block_tables.shape == (4, 3)
    assert batch.attn.block_tables.data_ptr() == tables.data_ptr()
    assert inputs.views["width"].tolist() == [3]
    assert tables[:12].tolist() == [0, 0, 0, 1, 2, 3, 4, 5, 0, 0, 0, 0]
    assert bool((tables[12:] == -7).all())  # never sent: 3 columns of 8,193 travelled


def test_widening_puts_each_compact_row_into_its_wide_row():
    wide = torch.full((3, 10), -1, dtype=torch.int32)
    compact = torch.arange(6, dtype=torch.int32)
    widen_tables(compact, torch.tensor([2], dtype=torch.int32), wide)
    assert wide[:, :2].tolist() == [[0, 1], [2, 3], [4, 5]]
    assert bool((wide[:, 2:] == -1).all())  # past the width: left alone, never read
    widen_tables_ref(compact, torch.tensor([0], dtype=torch.int32), wide)  # nothing to do


def test_eager_widths_come_in_few_buckets():
    assert [bucket_width(n, 8193) for n in (1, 16, 17, 100, 4097, 8193)] == [
        16, 16, 32, 128, 8192, 8193]
    assert bucket_width(3, 17) == 16 and bucket_width(17, 17) == 17


def _record_eagerly(fn, pool):
    class EagerGraph:  # a replay runs fn again into the capture's output
        def replay(self) -> None:
            out.copy_(fn())

        def pool(self) -> None:
            return None

    out = fn()
    return EagerGraph(), out


def test_a_decode_graph_reads_compact_tables_through_its_wide_one(tiny_qwen3_dir,
                                                                   monkeypatch):
    """DecodeGraphs captured for a much wider table than any step needs (the eager stand-in
    for capture on the CPU): steps whose width grows across a block boundary compute what
    the step laid out at full width does, built in place or copied in."""
    import gpu_workers.decode_graphs as decode_graphs

    monkeypatch.setattr(decode_graphs, "record", _record_eagerly)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    runner = make_runner(tiny_qwen3_dir, attention_backend="triton")
    table = runner.table
    rng = np.random.default_rng(4)
    seqs = [NewSequence(i, rng.integers(3, 600, n).tolist(), n, 0, n,
                        list(range(4 * i, 4 * i + 4)), SamplingParams(max_tokens=8))
            for i, n in enumerate([30, 12])]
    runner.execute(StepPlan(0, [], seqs, CachedSequences([], [], [])))
    full = runner.config.max_blocks_per_seq
    graphs = decode_graphs.DecodeGraphs(runner.model, 2, 64, 1024, CPU)
    widths = []
    with torch.inference_mode():
        graphs.capture()
        for step in range(1, 5):
            _, rows, num_new = table.apply(StepPlan(step, [], [], CachedSequences(
                [0, 1], [1, 1], [[], []])))
            batch = build_batch(table, rows, num_new, BLOCK_SIZE, CPU, **graphs.layout(2))
            widths.append(batch.attn.block_tables.shape[1])
            wide = build_batch(table, rows, num_new, BLOCK_SIZE, CPU, pad_to=2,
                               block_width=full)
            want = runner.model(wide.input_ids, wide.positions, wide.attn)
            got = graphs.run(batch.input_ids, batch.positions, batch.attn, 2)
            torch.testing.assert_close(got, want)
            compact = build_batch(table, rows, num_new, BLOCK_SIZE, CPU, pad_to=2)
            got = graphs.run(compact.input_ids, compact.positions, compact.attn, 2)
            torch.testing.assert_close(got, want)
            table.num_computed[rows] += 1
            table.append_placeholders(rows)
            table.fill_tokens(rows, table.num_tokens[rows] - 1, table.epoch[rows],
                              np.array([11, 12]) * step)
    assert widths == [2, 2, 3, 3]  # 31, 32, then 33 and 34 tokens: a third block


def _gpu_runner(model_dir, **kw):
    free, total = torch.cuda.mem_get_info()
    return make_runner(model_dir, **{"device": "cuda", "dtype": "float32",
                                     "kv_cache_bytes": 96 << 20,
                                     "gpu_memory_utilization": min(0.95, (total - free) / total
                                                                   + 0.05), **kw})


def _generate(runner, prompts, max_tokens):
    planner = Planner(BLOCK_SIZE, runner.num_kv_blocks)
    for i, p in enumerate(prompts):
        planner.add(i, p, max_tokens)
    return planner.run(runner)


@pytest.mark.gpu
def test_graphs_under_a_huge_limit_give_the_default_limits_tokens(monkeypatch):
    """On the GPU, graphs captured for 131,072 tokens (8,193 columns of 16-token blocks)
    replay steps whose tables travel a few columns wide, and the greedy tokens are those of
    the default limit's graphs and of eager execution."""
    import tempfile

    from tiny_models import make_tiny_model

    from gpu_workers.decode_graphs import DecodeGraphs

    widths = []
    run = DecodeGraphs.run

    def counted(self, ids, positions, attn, bs):
        widths.append((self.block_width, attn.block_tables.shape[1]))
        return run(self, ids, positions, attn, bs)

    monkeypatch.setattr(DecodeGraphs, "run", counted)
    with tempfile.TemporaryDirectory() as tmp:
        model = str(make_tiny_model("qwen3", tmp, max_position_embeddings=HUGE))
        prompts = random_prompts(8, [5, 40, 17, 100])
        default = _generate(_gpu_runner(model, max_model_len=256), prompts, 40)
        huge = _generate(_gpu_runner(model, max_model_len=HUGE), prompts, 40)
        eager = _generate(_gpu_runner(model, max_model_len=HUGE, enforce_eager=True),
                          prompts, 40)
    assert huge == default == eager
    at_huge = [w for full, w in widths if full == HUGE_WIDTH]
    assert at_huge and max(at_huge) == -(-140 // BLOCK_SIZE)  # 100 + 40 tokens at most
    assert min(at_huge) < max(at_huge)  # grew with the contexts
