"""A step's inputs written into a graph's static buffers: the segments hold what was put
(zeros after it), one copy carries them, and a batch built into them is the batch built
into fresh memory, including the sampler's inputs and the in-flight tokens patched in."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from rt_helpers import BLOCK_SIZE, make_runner

from gpu_workers.batch import build_batch
from gpu_workers.decode_graphs import input_capacities
from gpu_workers.pending_step import PendingStep, patch_in_flight, pending_patch
from gpu_workers.static_inputs import ALIGN, StaticInputs, send_named
from gpu_workers.token_layout import entry_offsets
from protocol import CachedSequences, NewSequence, SamplingParams, StepPlan

CPU = torch.device("cpu")


def test_segments_hold_what_was_put_and_zeros_after_it():
    inputs = StaticInputs({"ids": 5, "temps": 3, "seeds": 4, "unused": 2}, CPU)
    assert all(off % ALIGN == 0 for off in inputs.offsets.values())
    inputs.buffer.fill_(-7)  # an earlier step's values
    staged = inputs.stage()
    staged.put("ids", np.array([3, 1, 4], np.int64))
    staged.put("temps", np.array([0.5, 2.0], np.float32).view(np.int32))
    staged.put("seeds", np.array([2**40 + 3, -5], np.int64).view(np.int32))
    views = staged.send()
    assert views["ids"].tolist() == [3, 1, 4]
    assert inputs.views["ids"].tolist() == [3, 1, 4, 0, 0]
    assert views["temps"].view(torch.float32).tolist() == [0.5, 2.0]
    assert views["seeds"].view(torch.int64).tolist() == [2**40 + 3, -5]
    assert "unused" not in views and inputs.views["unused"].tolist() == [0, 0]
    assert views["ids"].data_ptr() == inputs.views["ids"].data_ptr()
    with pytest.raises(ValueError, match="do not fit segment 'temps'"):
        inputs.stage().put("temps", np.zeros(4, np.int32))


def test_fresh_and_static_sends_agree():
    arrays = {"a": np.arange(7), "b": np.array([1.5], np.float32).view(np.int32)}
    fresh = send_named(arrays, CPU)
    static = send_named(arrays, CPU, StaticInputs({"a": 8, "b": 1}, CPU))
    for name in arrays:
        assert torch.equal(fresh[name], static[name])


def _decoding_runner(model_dir: str):
    runner = make_runner(model_dir, attention_backend="triton")
    rng = np.random.default_rng(0)
    seqs, block = [], 0
    for i, n in enumerate([7, 30, 12]):
        nb = -(-(n + 8) // BLOCK_SIZE)
        seqs.append(NewSequence(i, rng.integers(3, 600, n).tolist(), n, 0, n,
                                list(range(block, block + nb)),
                                SamplingParams(temperature=0.8, max_tokens=8)))
        block += nb
    runner.execute(StepPlan(0, [], seqs, CachedSequences([], [], [])))  # prefill + 1 token
    return runner


def test_a_decode_batch_built_into_static_inputs_is_the_fresh_one(tiny_qwen3_dir):
    runner = _decoding_runner(tiny_qwen3_dir)
    table = runner.table
    _, rows, num_new = table.apply(StepPlan(1, [], [], CachedSequences([0, 1, 2], [1] * 3,
                                                                       [[], [], []])))
    width = runner.config.max_blocks_per_seq
    inputs = StaticInputs(input_capacities(4, 1, width), CPU)
    extra = {"inv_temperature": np.full(3, 1.25, np.float32).view(np.int32)}
    kw = dict(pad_to=4, q_per_seq=1, block_width=width, extra=extra)
    fresh = build_batch(table, rows, num_new, BLOCK_SIZE, CPU, **kw)
    static = build_batch(table, rows, num_new, BLOCK_SIZE, CPU, into=inputs, **kw)
    assert static.input_ids.data_ptr() == inputs.views["ids"].data_ptr()
    for got, want in ((static.input_ids, fresh.input_ids), (static.positions, fresh.positions),
                      (static.attn.slot_mapping, fresh.attn.slot_mapping),
                      (static.attn.block_tables, fresh.attn.block_tables),
                      (static.attn.seq_lens_k, fresh.attn.seq_lens_k),
                      (static.attn.cu_seqlens_k, fresh.attn.cu_seqlens_k),
                      (static.logits_indices, fresh.logits_indices),
                      (static.sampling.temperature, fresh.sampling.temperature),
                      (static.extra["inv_temperature"], fresh.extra["inv_temperature"])):
        assert torch.equal(got, want)
    assert static.extra["inv_temperature"].view(torch.float32).tolist() == [1.25] * 3
    with torch.inference_mode():
        h_fresh = runner.model(fresh.input_ids, fresh.positions, fresh.attn)
        h_static = runner.model(static.input_ids, static.positions, static.attn)
    torch.testing.assert_close(h_static[:3], h_fresh[:3])


@pytest.mark.parametrize("q_per_seq", [None, 4])
def test_in_flight_tokens_are_patched_where_their_entries_start(q_per_seq):
    """Rows 0 and 2 have a token still being sampled by the step in flight (slots 1 and 0 of
    its tokens); row 1's is known. The patch puts each value at its entry's token."""
    from gpu_workers.sequence_table import SequenceTable

    table = SequenceTable(4, 32, 2, vocab_size=100, num_blocks=8, block_size=16)
    seqs = [NewSequence(i, [5, 6, 7], 3, 2, 1, [i], SamplingParams()) for i in range(3)]
    _, rows, _ = table.apply(StepPlan(0, [], seqs, CachedSequences([], [], [])))
    table.num_computed[rows] = 3
    pos, epochs = table.append_placeholders(rows[[2, 0]])  # slots 0 and 1 of the step
    in_flight = PendingStep(0, table, [2, 0], rows[[2, 0]], pos, epochs,
                            tokens=torch.tensor([41, 40]), logprobs=None)
    table.append_placeholders(rows[[1]])
    table.fill_tokens(rows[[1]], table.num_tokens[rows[[1]]] - 1, table.epoch[rows[[1]]],
                      np.array([39]))
    start, num_new = table.num_computed[rows], np.ones(3, np.int64)
    offsets = entry_offsets(num_new, q_per_seq)
    patch = pending_patch(table, rows, start, num_new, offsets)
    assert patch["patch_to"].tolist() == [offsets[0], offsets[2]]
    assert patch["patch_from"].tolist() == [1, 0]
    layout = {} if q_per_seq is None else dict(pad_to=3, q_per_seq=q_per_seq)
    batch = build_batch(table, rows, num_new, 16, CPU, extra=patch, **layout)
    patch_in_flight(batch, in_flight)
    assert batch.input_ids[offsets].tolist() == [40, 39, 41]


class EagerGraph:
    """Stands in for a CUDA graph on the CPU: a replay runs the captured function again
    and writes its result where the capture's output was, as a replay does."""

    def __init__(self, fn) -> None:
        self.fn = fn

    def replay(self) -> None:
        self.out.copy_(self.fn())

    def pool(self) -> None:
        return None


def _record_eagerly(fn, pool):
    graph = EagerGraph(fn)
    graph.out = fn()
    return graph, graph.out


def test_decode_graphs_read_the_batch_built_into_their_inputs(tiny_qwen3_dir, monkeypatch):
    """Two decode steps through DecodeGraphs with an eager stand-in for capture: each replay
    reads the step built into its size's inputs (no copies), the sampling graph reads the
    step's inverse temperatures and seeds, and inputs built elsewhere are copied in."""
    import gpu_workers.decode_graphs as decode_graphs

    monkeypatch.setattr(decode_graphs, "record", _record_eagerly)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    runner = _decoding_runner(tiny_qwen3_dir)
    table, width = runner.table, runner.config.max_blocks_per_seq

    def sample(hidden, inv_temperature, seeds):  # anything that reads all three
        return hidden[:, 0].double().mul(inv_temperature).add(seeds).round().long()

    graphs = decode_graphs.DecodeGraphs(runner.model, 4, width, runner.config.max_model_len,
                                      CPU, sample=sample)
    with torch.inference_mode():
        graphs.capture()
        for step in (1, 2):
            _, rows, num_new = table.apply(StepPlan(step, [], [], CachedSequences(
                [0, 1, 2], [1] * 3, [[], [], []])))
            bs = graphs.bucket(len(rows))
            inv = np.array([0.5, 2.0, 0.0], np.float32)
            seeds = np.array([7, 2**40, -3], np.int64)
            extra = {"inv_temperature": inv.view(np.int32), "seeds": seeds.view(np.int32)}
            batch = build_batch(table, rows, num_new, BLOCK_SIZE, CPU, block_width=width,
                                extra=extra, **graphs.layout(bs))
            fresh = build_batch(table, rows, num_new, BLOCK_SIZE, CPU, block_width=width,
                                pad_to=bs)
            want = runner.model(fresh.input_ids, fresh.positions, fresh.attn)
            hidden = graphs.run(batch.input_ids, batch.positions, batch.attn, bs)
            torch.testing.assert_close(hidden[:3], want[:3])
            tokens = graphs.sample_step(bs, 3)
            assert tokens.tolist() == sample(hidden[:3], torch.from_numpy(inv).double(),
                                             torch.from_numpy(seeds)).tolist()
            # Built anywhere else (the draft model's steps): copied into the inputs.
            hidden = graphs.run(fresh.input_ids, fresh.positions, fresh.attn, bs)
            torch.testing.assert_close(hidden[:3], want[:3])
            table.num_computed[rows] += 1
            table.append_placeholders(rows)
            table.fill_tokens(rows, table.num_tokens[rows] - 1, table.epoch[rows],
                              np.array([11, 12, 13]) * step)


def test_the_decode_graph_layout_computes_what_the_ragged_one_does(tiny_qwen3_dir):
    runner = _decoding_runner(tiny_qwen3_dir)
    table = runner.table
    _, rows, num_new = table.apply(StepPlan(1, [], [], CachedSequences([0, 1, 2], [1] * 3,
                                                                       [[], [], []])))
    ragged = build_batch(table, rows, num_new, BLOCK_SIZE, CPU)
    padded = build_batch(table, rows, num_new, BLOCK_SIZE, CPU, pad_to=8, sample=False)
    assert padded.sampling is None and ragged.sampling is not None
    assert padded.input_ids.shape[0] == 8 and padded.attn.decode
    assert padded.attn.slot_mapping[3:].tolist() == [-1] * 5  # padding stores nothing
    assert padded.attn.seq_lens_k[3:].tolist() == [1] * 5
    assert torch.equal(padded.attn.slot_mapping[:3], ragged.attn.slot_mapping)
    with torch.inference_mode():
        h_ragged = runner.model(ragged.input_ids, ragged.positions, ragged.attn)
        h_padded = runner.model(padded.input_ids, padded.positions, padded.attn)
    torch.testing.assert_close(h_padded.index_select(0, padded.logits_indices),
                               h_ragged.index_select(0, ragged.logits_indices))


def test_entry_offsets_are_the_layouts_with_proposals_too(tiny_qwen3_dir):
    """The in-flight patch is placed before the batch exists: the offsets it uses must be
    those the layout gives every entry, proposals to verify included."""
    runner = _decoding_runner(tiny_qwen3_dir)
    table = runner.table
    _, rows, num_new = table.apply(StepPlan(1, [], [], CachedSequences([0, 1, 2], [1] * 3,
                                                                       [[], [], []])))
    num_verify = np.array([2, 0, 3])
    run_new = num_new + num_verify
    ragged = build_batch(table, rows, run_new, BLOCK_SIZE, CPU, num_verify=num_verify)
    assert entry_offsets(run_new).tolist() == ragged.token_offsets.tolist() == [0, 3, 4]
    padded = build_batch(table, rows, run_new, BLOCK_SIZE, CPU, num_verify=num_verify,
                         pad_to=4, q_per_seq=4)
    assert entry_offsets(run_new, 4).tolist() == padded.token_offsets.tolist()


def test_prefill_graphs_read_the_batch_built_into_their_inputs(tiny_qwen3_dir, monkeypatch):
    """A prefill step through PrefillGraphs with the eager stand-in for capture: the replay
    reads the step built into its bucket's inputs and computes what the ragged step does."""
    import gpu_workers.decode_graphs as decode_graphs
    from gpu_workers.prefill_graphs import PrefillGraphs

    monkeypatch.setattr(decode_graphs, "record", _record_eagerly)
    monkeypatch.setattr("gpu_workers.prefill_graphs.record", _record_eagerly)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    runner = make_runner(tiny_qwen3_dir, attention_backend="triton")
    table, width = runner.table, runner.config.max_blocks_per_seq
    graphs = PrefillGraphs(runner.model, 2, 128, width, runner.config.max_model_len, CPU)
    rng = np.random.default_rng(2)
    seqs = [NewSequence(i, rng.integers(3, 600, n).tolist(), n, 0, n, [2 * i, 2 * i + 1],
                        SamplingParams()) for i, n in enumerate([9, 30])]
    _, rows, num_new = table.apply(StepPlan(0, [], seqs, CachedSequences([], [], [])))
    assert num_new.tolist() == [9, 30]
    assert _replay_equals_ragged(runner, graphs, rows, num_new) == (2, 128)


def _replay_equals_ragged(runner, graphs, rows, num_new) -> tuple[int, int]:
    """Capture (eagerly), build the step into its bucket's inputs, replay, and compare the
    sampled rows with the ragged step's; the bucket it used."""
    table, width = runner.table, runner.config.max_blocks_per_seq
    with torch.inference_mode():
        graphs.capture()
        key = graphs.bucket(len(rows), int(num_new.sum()))
        batch = build_batch(table, rows, num_new, BLOCK_SIZE, CPU, block_width=width,
                            **graphs.layout(key))
        assert batch.input_ids.data_ptr() == graphs.inputs[key].views["ids"].data_ptr()
        ragged = build_batch(table, rows, num_new, BLOCK_SIZE, CPU, block_width=width)
        want = runner.model(ragged.input_ids, ragged.positions, ragged.attn)
        got = graphs.run(batch.input_ids, batch.positions, batch.attn, key)
    torch.testing.assert_close(got.index_select(0, batch.logits_indices),
                               want.index_select(0, ragged.logits_indices), atol=1e-4,
                               rtol=1e-4)
    return key


def test_a_mixed_step_replays_a_prefill_graph_too(tiny_qwen3_dir, monkeypatch):
    """New prompts joining decoding sequences make one step of five entries: it has a prefill
    graph's bucket (not eager launches) and computes what the ragged step does."""
    from gpu_workers.prefill_graphs import PrefillGraphs

    monkeypatch.setattr("gpu_workers.prefill_graphs.record", _record_eagerly)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    runner = _decoding_runner(tiny_qwen3_dir)
    table, width = runner.table, runner.config.max_blocks_per_seq
    graphs = PrefillGraphs(runner.model, 6, 128, width, runner.config.max_model_len, CPU)
    rng = np.random.default_rng(3)
    new = [NewSequence(3 + i, rng.integers(3, 600, n).tolist(), n, 0, n, [20 + 4 * i,
                                                                        21 + 4 * i],
                       SamplingParams()) for i, n in enumerate([25, 17])]
    _, rows, num_new = table.apply(StepPlan(1, [], new, CachedSequences([0, 1, 2], [1] * 3,
                                                                        [[], [], []])))
    assert sorted(num_new.tolist()) == [1, 1, 1, 17, 25]
    assert _replay_equals_ragged(runner, graphs, rows, num_new) == (6, 128)


def test_prefill_buckets_hold_every_step_up_to_the_largest():
    """Entry buckets are coarse (an empty entry costs nothing), token buckets fine; a bucket
    never has more entries than tokens, and a step past the largest runs eagerly."""
    from gpu_workers.prefill_graphs import PrefillGraphs, entry_buckets

    assert entry_buckets(256) == [1, 4, 16, 64, 256]
    assert entry_buckets(6) == [1, 4, 6]
    graphs = PrefillGraphs(torch.nn.Identity(), 256, 2048, 4, 1024, CPU)
    assert graphs.entry_sizes == [1, 4, 16, 64]  # more entries: the GPU hides the launches
    assert all(s <= t for s, t in graphs.inputs)
    assert graphs.bucket(1, 1024) == (1, 1024)
    assert graphs.bucket(1, 1030) == (1, 1536)
    assert graphs.bucket(11, 210) == (16, 256)  # ten decoding rows and a 200-token prompt
    assert graphs.bucket(16, 16) == (16, 128)
    assert graphs.bucket(17, 300) == (64, 512)
    assert graphs.bucket(65, 300) is None
    assert graphs.bucket(3, 2049) is None
    # max_model_len 1,000: its longest prompt has a bucket of its own, not eager launches
    short = PrefillGraphs(torch.nn.Identity(), 256, 1000, 4, 1000, CPU)
    assert short.token_sizes == [128, 256, 512, 768, 1000]
    assert short.bucket(1, 999) == (1, 1000)
