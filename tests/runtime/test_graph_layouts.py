"""The padded layouts CUDA graphs use, checked on the CPU against the ragged layout: same
hidden states at every position the sampler reads, and padding stores nothing. Verify steps:
every entry computes a fixed number of tokens, its own then padding. Prefill steps: empty
entries and one entry of padding tokens after the real ones."""

from __future__ import annotations

import numpy as np
import torch
from rt_helpers import BLOCK_SIZE, make_runner

from gpu_workers.batch import build_batch
from protocol import CachedSequences, NewSequence, SamplingParams, StepPlan


def test_padded_verify_layout_matches_the_ragged_one(tiny_qwen3_dir):
    runner = make_runner(tiny_qwen3_dir, attention_backend="triton")
    table = runner.table
    rng = np.random.default_rng(0)
    lens = [5, 19, 33]
    seqs, block = [], 0
    for i, n in enumerate(lens):
        nb = -(-(n + 8) // BLOCK_SIZE)
        seqs.append(NewSequence(i, rng.integers(3, 600, n).tolist(), n, 0, n,
                                list(range(block, block + nb)), SamplingParams(max_tokens=16)))
        block += nb
    runner.execute(StepPlan(0, [], seqs, CachedSequences([], [], [])))  # prefill + 1 token
    ids, rows, num_new = table.apply(StepPlan(1, [], [], CachedSequences([0, 1, 2], [1] * 3,
                                                                         [[], [], []])))
    # Proposals past each sequence's known tokens: 3, 0 and 2 of them.
    num_verify = np.array([3, 0, 2])
    for row, v in zip(rows, num_verify, strict=True):
        n = table.num_tokens[row]
        table.tokens[row, n:n + v] = rng.integers(3, 600, v)
    run_new = num_new + num_verify

    ragged = build_batch(table, rows, run_new, BLOCK_SIZE, runner.device, num_verify=num_verify)
    padded = build_batch(table, rows, run_new, BLOCK_SIZE, runner.device, pad_to=4,
                         num_verify=num_verify, q_per_seq=4)
    assert padded.attn.decode and padded.attn.q_per_seq == 4
    assert padded.input_ids.shape[0] == 16
    # Padding stores nothing: one slot per real token.
    assert int((padded.attn.slot_mapping >= 0).sum()) == int(run_new.sum())
    assert padded.token_offsets.tolist() == [0, 4, 8]
    with torch.inference_mode():
        h_ragged = runner.model(ragged.input_ids, ragged.positions, ragged.attn)
        h_padded = runner.model(padded.input_ids, padded.positions, padded.attn)
    want = h_ragged.index_select(0, ragged.logits_indices)
    got = h_padded.index_select(0, padded.logits_indices)
    assert got.shape[0] == int(run_new.sum())
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_padded_prefill_layout_matches_the_ragged_one(tiny_qwen3_dir):
    runner = make_runner(tiny_qwen3_dir, attention_backend="triton")
    table = runner.table
    rng = np.random.default_rng(1)
    lens, seqs, block = [23, 40], [], 0
    for i, n in enumerate(lens):
        nb = -(-(n + 1) // BLOCK_SIZE)
        seqs.append(NewSequence(i, rng.integers(3, 600, n).tolist(), n, 0, n,
                                list(range(block, block + nb)), SamplingParams(max_tokens=4)))
        block += nb
    _, rows, num_new = table.apply(StepPlan(0, [], seqs, CachedSequences([], [], [])))
    width = runner.config.max_blocks_per_seq  # static on CUDA, so the padding entry fits
    ragged = build_batch(table, rows, num_new, BLOCK_SIZE, runner.device, block_width=width)
    padded = build_batch(table, rows, num_new, BLOCK_SIZE, runner.device, block_width=width,
                         prefill_pad=(4, 128))
    assert padded.input_ids.shape[0] == 128 and not padded.attn.decode
    assert padded.attn.cu_seqlens_q.tolist() == [0, 23, 63, 63, 63, 128]
    assert padded.attn.seq_lens_k.tolist() == [23, 40, 0, 0, 65]
    assert int((padded.attn.slot_mapping >= 0).sum()) == sum(lens)
    with torch.inference_mode():
        want = runner.model(ragged.input_ids, ragged.positions, ragged.attn)
        k_after_ragged = [a.k_cache.clone() for a in runner.model.attention_layers()]
        got = runner.model(padded.input_ids, padded.positions, padded.attn)
    rows_read = padded.logits_indices
    torch.testing.assert_close(got.index_select(0, rows_read),
                               want.index_select(0, ragged.logits_indices), atol=1e-4,
                               rtol=1e-4)
    torch.testing.assert_close(got[:sum(lens)], want, atol=1e-4, rtol=1e-4)
    # The padding wrote nothing into the cache (block 0, which it reads, included).
    for layer, before in zip(runner.model.attention_layers(), k_after_ragged, strict=True):
        torch.testing.assert_close(layer.k_cache, before, atol=1e-5, rtol=1e-5)


def test_a_decode_step_laid_out_in_its_staged_inputs_equals_the_fresh_layout():
    """Written in place, every element of the graph's segments is set (the staging memory
    holds an earlier step's values), and each segment equals the fresh arrays' part."""
    from gpu_workers.decode_graphs import input_capacities
    from gpu_workers.sequence_table import SequenceTable
    from gpu_workers.static_inputs import StaticInputs
    from gpu_workers.token_layout import PART_NAMES, lay_out

    bs, width, block = 4, 3, 4
    table = SequenceTable(4, 12, width, vocab_size=100, num_blocks=16, block_size=block)
    seqs = [NewSequence(i, list(range(5, 5 + n)), n, 0, n, [3 * i + b for b in range(width)],
                        SamplingParams()) for i, n in enumerate([2, 9, 5])]
    table.apply(StepPlan(0, [], seqs, CachedSequences([], [], [])))
    rows = np.array([table.rows[2], table.rows[0], table.rows[1]])
    start = table.num_tokens[rows] - 1
    ones = np.ones(3, np.int64)
    fresh = lay_out(table, rows, start, ones, block, width, pad_to=bs)
    staged = StaticInputs(input_capacities(bs, 1, width), torch.device("cpu")).stage()
    staged.array[:] = 7  # an earlier step's values
    in_place = lay_out(table, rows, start, ones, block, width, pad_to=bs, staged=staged)
    for name, want in zip(PART_NAMES, fresh.parts(), strict=True):
        assert staged.segment(name).tolist() == want.tolist(), name
        assert staged.lengths[name] == len(want)
    # Position 4 of seq 2 is in its block 7, 1 of seq 0 in block 0, 8 of seq 1 in block 5.
    assert fresh.slots.tolist() == [7 * block, 1, 5 * block, -1]
    assert in_place.last.tolist() == fresh.last.tolist() == [0, 1, 2]
    assert in_place.max_k == fresh.max_k == 9
