"""The start-up's scratch steps (gpu_workers.warm_up) as plans: the profiling step is the
largest the scheduler may send, and every warm-up shape is a prefill the runner accepts,
then one decode step of the same sequences. On CUDA they run at start-up (and, with
--precompile-kernels, inside a capture first); here a CPU runner runs the same plans."""

from __future__ import annotations

from rt_helpers import make_runner

from gpu_workers.step_graphs import StepGraphs
from gpu_workers.warm_up import decode_plan, peak_step, prefill_plan, warm_up_steps


def test_the_profiling_step_fills_the_token_budget_over_the_widest_batch(tiny_qwen3_dir):
    runner = make_runner(tiny_qwen3_dir, max_num_seqs=16, max_num_batched_tokens=1000)
    seqs, blocks = peak_step(runner.config)
    assert len(seqs) == 16
    assert sum(s.num_new for s in seqs) == 1000
    tables = [b for s in seqs for b in s.block_table]
    assert sorted(tables) == list(range(blocks))  # each block written by one sequence
    result = runner.run_on(prefill_plan(seqs), runner.new_table())
    assert len(result.token_ids) == 16


def test_each_warm_up_shape_prefills_then_decodes_within_the_pool(tiny_qwen3_dir):
    runner = make_runner(tiny_qwen3_dir)
    steps = warm_up_steps(runner.config, runner.num_kv_blocks)
    assert [len(seqs) for seqs in steps] == [1, 1, 3, 16, 17]
    for seqs in steps:
        assert max(b for s in seqs for b in s.block_table) < runner.num_kv_blocks
        table = runner.new_table()
        first = runner.run_on(prefill_plan(seqs), table)
        second = runner.run_on(decode_plan(seqs), table)
        assert len(first.token_ids) == len(second.token_ids) == len(seqs)


def test_a_small_pool_drops_the_shapes_sequences_that_do_not_fit(tiny_qwen3_dir):
    runner = make_runner(tiny_qwen3_dir)
    steps = warm_up_steps(runner.config, num_blocks=4)
    assert all(sum(len(s.block_table) for s in seqs) <= 4 for seqs in steps)


def test_the_recording_pass_runs_every_scratch_plan_with_its_tokens_settled_as_zeros(
        tiny_qwen3_dir, monkeypatch):
    """The recording's host side on a CPU runner: the CUDA capture, stream and cache calls
    are stood in for (the steps then really run, on the CPU), so what is checked is that
    every plan the recording sends is one the runner's mirror accepts, the decode steps
    after tokens that were settled as zeros included."""
    import contextlib

    import torch

    from gpu_workers import startup_kernels

    sent = []
    runner = make_runner(tiny_qwen3_dir)
    launch_on = runner.launch_on

    def recorded_launch(plan, table):
        pending = launch_on(plan, table)
        sent.append((plan, len(pending.rows)))
        return pending

    monkeypatch.setattr(runner, "launch_on", recorded_launch)
    class NoCapture:
        def register_generator_state(self, generator):
            assert generator in (runner.sampler.generator, runner.sampler.row_generator)

        def capture_begin(self, capture_error_mode):
            assert capture_error_mode == "relaxed"

        def capture_end(self):
            pass

    monkeypatch.setattr(torch.cuda, "CUDAGraph", NoCapture)
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "Stream", lambda device: None)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    captured = []
    real_captured = startup_kernels._captured
    monkeypatch.setattr(startup_kernels, "_captured",
                        lambda *args: captured.append(real_captured(*args)) or captured[-1])
    assert startup_kernels.record_startup_kernels(runner) == []  # no Triton on the CPU path
    graphs = StepGraphs(runner.model, runner.config, runner.device, lambda text: None,
                        capture=False)
    # Every step and every graph's warm-up ran whole.
    assert captured == [True] * (len(sent) + len(graphs.warm_ups()))
    shapes = warm_up_steps(runner.config, 1 << 62)
    assert len(sent) == 1 + 2 * len(shapes)
    decodes = sent[2::2]
    assert [rows for _, rows in decodes] == [len(seqs) for seqs in shapes]
    assert all(plan.cached.seq_ids for plan, _ in decodes)


def test_a_scratch_cache_unbound_from_the_layers_is_freed_with_its_last_reference(
        tiny_qwen3_dir):
    """The kernel recording's scratch cache is unbound before the peak is measured: bound, the
    layers' views would keep it allocated through the measurement, which would count it."""
    import gc
    import weakref

    from gpu_workers.kv_cache import KVCache

    runner = make_runner(tiny_qwen3_dir)
    layers = runner.model.attention_layers()
    scratch = KVCache(runner.model_config, 8, runner.config.block_size, runner.device)
    scratch.bind(layers)
    storage = weakref.ref(scratch.storage)
    assert all(layer.k_cache.numel() > 0 for layer in layers)
    KVCache.unbind(layers)
    del scratch
    gc.collect()
    assert storage() is None
    assert all(layer.k_cache.numel() == 0 == layer.v_cache.numel() for layer in layers)
