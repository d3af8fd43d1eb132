"""Launching step N+1 before step N's tokens reached the host gives the same tokens.

The real Scheduler (overlap on: plan N+1 leaves before result N is processed) drives a real
ModelRunner on the CPU. With lookahead the runner launches N+1 first and only then finishes
N, so every decode input that step N is still sampling is copied on the device, and rows that
were dropped, preempted or re-sent in between must not receive a late token.
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest
from rt_helpers import make_runner

from protocol import AddRequest, SamplingParams
from scheduler_proc import Scheduler, SchedulerConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scheduler"))
from fake_worker import Collector, drive  # noqa: E402
from lookahead_driver import drive_lookahead  # noqa: E402

MAX_MODEL_LEN = 96


class LazyResult:
    """A StepResult that finishes its step only when the scheduler first reads it."""

    def __init__(self, runner, pending) -> None:
        self._runner, self._pending, self._result = runner, pending, None

    def __getattr__(self, name: str):
        if self._result is None:
            self._result = self._runner.finish(self._pending)
        return getattr(self._result, name)


class SyncWorker:
    def __init__(self, runner) -> None:
        self.runner = runner
        self.resent = 0
        self.seen: set[int] = set()

    def execute(self, plan):
        for seq in plan.new_seqs:
            self.resent += seq.seq_id in self.seen
            self.seen.add(seq.seq_id)
        return self.run(plan)

    def run(self, plan):
        return self.runner.execute(plan)


class LookaheadWorker(SyncWorker):
    """Launches each plan at once; its result is finished after the next plan launched."""

    def run(self, plan):
        return LazyResult(self.runner, self.runner.launch(plan))


def requests(seed: int, n: int = 14) -> list[AddRequest]:
    rng = random.Random(seed)
    shared = [rng.randrange(3, 600) for _ in range(20)]
    out = []
    for rid in range(n):
        prompt = shared[: rng.choice([0, 16, 20])] + [rng.randrange(3, 600)
                                                       for _ in range(rng.randint(1, 30))]
        kind = rid % 4
        params = SamplingParams(
            temperature=0.0 if kind in (0, 2) else 1.0,
            seed=None if kind != 1 else 100 + rid, top_k=-1 if kind != 3 else 40,
            max_tokens=rng.randint(4, MAX_MODEL_LEN - len(prompt) - 2), ignore_eos=kind == 0,
            frequency_penalty=0.8 if kind == 2 else 0.0)
        out.append(AddRequest(rid, prompt, params, [2]))
    return out


def generate(model_dir: str, reqs: list[AddRequest], worker_cls, kv_bytes: int,
             attach=None, **runner_kw) -> dict:
    """attach(runner), when given, changes the runner before it runs (graphs, sampler)."""
    runner = make_runner(model_dir, **{"max_model_len": MAX_MODEL_LEN, "kv_cache_bytes": kv_bytes,
                                       "max_num_seqs": 8, "max_num_batched_tokens": 64,
                                       **runner_kw})
    if attach is not None:
        attach(runner)
    sched = Scheduler(SchedulerConfig(runner.num_kv_blocks, runner.config.block_size,
                                      max_num_seqs=8, max_num_batched_tokens=64,
                                      max_model_len=MAX_MODEL_LEN, overlap=True))
    for r in reqs:
        sched.add_request(r)
    worker = worker_cls(runner)
    out = drive(sched, worker, Collector()).outputs
    assert not runner._unsettled
    return {rid: (o.token_ids, o.finish_reason) for rid, o in out.items()}, worker.resent


@pytest.mark.parametrize("kv_bytes", [1 << 20, 12 * 8192])  # roomy; 12 blocks: preemptions
def test_lookahead_equals_step_by_step(tiny_qwen3_dir, kv_bytes):
    reqs = requests(kv_bytes)
    sync, _ = generate(tiny_qwen3_dir, reqs, SyncWorker, kv_bytes)
    ahead, resent = generate(tiny_qwen3_dir, reqs, LookaheadWorker, kv_bytes)
    assert ahead == sync
    assert all(reason is not None for _, reason in ahead.values())
    assert (resent > 0) == (kv_bytes < 1 << 20)  # the tight pool preempts and re-sends


@pytest.mark.parametrize("deep_limit", [None, 2])
@pytest.mark.parametrize("kv_bytes", [1 << 20, 12 * 8192])
def test_planning_two_steps_ahead_equals_step_by_step(tiny_qwen3_dir, kv_bytes, deep_limit):
    """plans_ahead=2: the scheduler sends plan N+2 before result N, the worker launches it
    while N+1 runs; the block tables agree after each launch, every request finishes, and
    greedy and seeded requests give step by step's tokens. (Unseeded ones draw from the
    engine's generator, whose draws follow the batches, which differ: a finished sequence is
    computed once more and admissions come a step later.) With a deep limit of 2 (the GPU
    default's policy, with a smaller limit) the depth changes between steps: two ahead only
    for steps of at most two decoding entries."""
    reqs = requests(kv_bytes + 1)
    sync, _ = generate(tiny_qwen3_dir, reqs, SyncWorker, kv_bytes)
    runner = make_runner(tiny_qwen3_dir, max_model_len=MAX_MODEL_LEN, kv_cache_bytes=kv_bytes,
                         max_num_seqs=8, max_num_batched_tokens=64, max_plans_in_flight=3)
    sched = Scheduler(SchedulerConfig(runner.num_kv_blocks, runner.config.block_size,
                                      max_num_seqs=8, max_num_batched_tokens=64,
                                      max_model_len=MAX_MODEL_LEN, plans_ahead=2,
                                      deep_plan_max_seqs=deep_limit))
    assert sched.config.max_plans_in_flight == 3
    sched.pacing = None  # the depth follows the batch alone, not this host's timing
    plans = []
    launch = runner.launch
    runner.launch = lambda plan, *args: plans.append(plan) or launch(plan, *args)
    for r in reqs:
        sched.add_request(r)
    collected = drive_lookahead(sched, runner)
    out = collected.outputs
    deep = [plan for plan, depth in zip(plans, collected.outstanding_at_plan, strict=True)
            if depth == 2]
    assert deep
    if deep_limit is not None:
        assert all(not p.new_seqs and len(p.cached.seq_ids) <= 2 for p in deep)
    got = {rid: (o.token_ids, o.finish_reason) for rid, o in out.items()}
    assert got.keys() == sync.keys() and all(reason is not None for _, reason in got.values())
    deterministic = [r.request_id for r in reqs
                     if r.params.temperature == 0.0 or r.params.seed is not None]
    assert len(deterministic) >= len(reqs) // 2
    assert {rid: got[rid] for rid in deterministic} == {rid: sync[rid] for rid in deterministic}
    assert not runner._unsettled


def test_graph_steps_with_lookahead_on_the_cpu(tiny_qwen3_dir, monkeypatch):
    """The CUDA-graph paths with capture stood in by eager replays (test_static_inputs):
    decode and prefill steps built into static inputs, tokens drawn by the sampling graph,
    the in-flight token patched into a graph's static ids. Lookahead equals step by step,
    and greedy and seeded requests get the tokens of the runner without graphs."""
    import torch
    from test_static_inputs import _record_eagerly

    import gpu_workers.decode_graphs as decode_graphs
    import gpu_workers.model_runner as model_runner
    import gpu_workers.prefill_graphs as prefill_graphs
    from gpu_workers.graph_sampling import graph_sample_fn
    from gpu_workers.step_graphs import StepGraphs

    for module in (decode_graphs, prefill_graphs):
        monkeypatch.setattr(module, "record", _record_eagerly)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    replays, drawn, patched = [], [], []
    patch = model_runner.patch_in_flight

    def counted_patch(batch, in_flight) -> None:
        if batch.extra and "patch_to" in batch.extra:
            patched.append(batch.input_ids.data_ptr())
        patch(batch, in_flight)

    monkeypatch.setattr(model_runner, "patch_in_flight", counted_patch)

    def one_pass(runner) -> None:
        runner.sampler.one_pass = True

    def with_graphs(runner) -> None:
        one_pass(runner)
        with torch.inference_mode():
            runner.graphs = StepGraphs(runner.model, runner.config, runner.device,
                                       lambda text: None,
                                       graph_sample_fn(runner.model, runner.sampler, 1))
        for graphs in (runner.graphs.decode, runner.graphs.prefill):
            run = graphs.run
            graphs.run = lambda *args, run=run: replays.append(args[-1]) or run(*args)
        sample = runner.graphs.decode.sample_step
        runner.graphs.decode.sample_step = lambda *a: drawn.append(a) or sample(*a)
        static_ids.update(i.views["ids"].data_ptr()
                          for i in runner.graphs.decode.inputs.values())

    static_ids: set[int] = set()
    reqs = requests(5)
    # The runner's limits admit a 128-token prefill graph; the scheduler's stay as they are.
    kw = dict(max_model_len=128, max_num_batched_tokens=128)
    plain, _ = generate(tiny_qwen3_dir, reqs, SyncWorker, 1 << 20, attach=one_pass, **kw)
    sync, _ = generate(tiny_qwen3_dir, reqs, SyncWorker, 1 << 20, attach=with_graphs, **kw)
    ahead, _ = generate(tiny_qwen3_dir, reqs, LookaheadWorker, 1 << 20, attach=with_graphs,
                        **kw)
    assert ahead == sync
    assert any(isinstance(key, int) for key in replays)  # decode graphs ran
    assert any(isinstance(key, tuple) for key in replays)  # prefill graphs ran
    assert drawn  # steps sampled inside their graph
    assert static_ids & set(patched)  # in-flight tokens patched into a graph's static ids
    for r in reqs:
        if r.params.temperature == 0 or r.params.seed is not None:
            assert sync[r.request_id] == plain[r.request_id], r.request_id


@pytest.mark.gpu
@pytest.mark.parametrize("enforce_eager", [False, True])
def test_lookahead_equals_step_by_step_on_cuda(tiny_qwen3_dir, enforce_eager):
    """The same on a GPU, where step N really is still running when N+1 is launched (CUDA
    graphs for decode, or eager kernels)."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    import gc

    reqs = requests(7)
    out = []
    for worker_cls in (SyncWorker, LookaheadWorker):
        gc.collect()
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info()  # a small pool on top of what is in use
        util = min(0.95, (total - free) / total + 0.02)
        out.append(generate(tiny_qwen3_dir, reqs, worker_cls, None, device="cuda",
                            gpu_memory_utilization=util, enforce_eager=enforce_eager)[0])
    assert out[1] == out[0]


def test_a_late_token_never_lands_in_a_row_given_to_another_sequence():
    import numpy as np

    from gpu_workers.sequence_table import SequenceTable
    from protocol import CachedSequences, NewSequence, StepPlan

    def plan(step, drops=(), new=()):
        return StepPlan(step, list(drops), list(new), CachedSequences([], [], []))

    greedy = SamplingParams(temperature=0.0)
    table = SequenceTable(4, 64, 4)
    table.apply(plan(0, new=[NewSequence(1, [5] * 10, 10, 0, 10, [0], greedy)]))
    row = table.rows[1]
    pos, epochs = table.append_placeholders(np.array([row]))  # step 0 samples seq 1
    assert table.pending_pos[row] == 10
    # Step 1 is planned before that token is known: seq 1 leaves, seq 2 takes its row.
    table.apply(plan(1, drops=[1], new=[NewSequence(2, list(range(20)), 20, 0, 20, [1, 2],
                                                    greedy)]))
    assert table.rows[2] == row and table.pending_pos[row] == -1
    table.fill_tokens(np.array([row]), pos, epochs, np.array([999]))
    assert table.tokens[row, :20].tolist() == list(range(20))
