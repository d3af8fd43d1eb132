"""Preemption by swap through the scheduler: the KV of a preempted sequence goes to the host
tier in the plan that preempts it and comes back before the forward that reads it."""

from __future__ import annotations

import pytest
from fake_worker import FakeWorker, drive, make_request
from test_sched_prefix_preemption import assert_reference

from scheduler_proc import Scheduler, SchedulerConfig

BS = 4


def setup(num_blocks=10, host_slots=64, **kw):
    kw.setdefault("max_model_len", 128)
    cfg = SchedulerConfig(num_blocks, BS, num_host_slots=host_slots, **kw)
    poison = not cfg.enable_prefix_caching
    return Scheduler(cfg), FakeWorker(num_blocks, BS, poison_dropped=poison)


def crowd(sched, prompts=(9, 10, 11), max_tokens=24):
    """More sequences than the device pool holds once they grow; the last admitted (the
    first preempted) is mid-block when the first needs a new block."""
    reqs = [make_request(i, n, max_tokens=max_tokens, ignore_eos=True)
            for i, n in enumerate(prompts, 1)]
    for r in reqs:
        sched.add_request(r)
    return reqs


@pytest.mark.parametrize("caching", [False, True])
@pytest.mark.parametrize("mode", ["off", "overlap", "two ahead"])
def test_swapped_sequences_resume_from_the_host_with_reference_tokens(mode, caching):
    sched, worker = setup(overlap=mode != "off", plans_ahead=2 if mode == "two ahead" else 1,
                          enable_prefix_caching=caching)
    reqs = crowd(sched)
    out = drive(sched, worker)
    # The fake worker checks every context it reads; with caching off it wipes a dropped
    # sequence's blocks, so a resumed sequence reads only what the loads brought back.
    assert_reference(reqs, out.outputs)
    stats = sched.stats()
    assert stats.host_swaps_out > 0 and stats.host_swaps_in > 0
    assert stats.preemptions >= stats.host_swaps_out >= stats.host_swaps_in
    if not caching:  # no cached prefix blocks: every slot was a swap's, all given back
        assert stats.host_blocks_used == 0
    assert not sched.state.kv_tier.swapped


def test_the_preempting_plan_stores_every_block_and_the_resuming_plan_loads_them():
    sched, worker = setup(overlap=False, enable_prefix_caching=False)
    crowd(sched)
    tier = sched.state.kv_tier
    swapped = None
    while swapped is None:
        tables = {s.seq_id: (list(s.block_table), s.num_computed) for s in sched.running}
        plan = sched.schedule()
        sched.process_result(worker.execute(plan))
        if tier.swapped:
            [(sid, swapped)] = tier.swapped.items()
    table, computed = tables[sid]
    assert plan.drop_seq_ids == [sid] and swapped.num_tokens == computed
    # Every block with computed KV, the partial last one included, in order.
    assert computed % BS and len(swapped.host_slots) == -(-computed // BS)
    assert plan.moves.store_device_blocks == table[:len(swapped.host_slots)]
    assert plan.moves.store_host_slots == swapped.host_slots
    while sid in tier.swapped:
        plan = sched.schedule()
        sched.process_result(worker.execute(plan))
    [ns] = [ns for ns in plan.new_seqs if ns.seq_id == sid]
    assert ns.num_computed == computed and ns.num_new == len(ns.token_ids) - computed
    loads = dict(zip(plan.moves.load_device_blocks, plan.moves.load_host_slots, strict=True))
    assert [loads[b] for b in ns.block_table[:len(swapped.host_slots)]] == swapped.host_slots
    assert tier.host.num_used == 0  # its slots are given back once that plan is built


@pytest.mark.parametrize("why", ["short", "host full", "no tier"])
def test_recompute_is_the_fallback(why):
    kw = {"short": dict(swap_min_tokens=1000), "host full": dict(host_slots=2),
          "no tier": dict(host_slots=0)}[why]
    sched, worker = setup(overlap=False, enable_prefix_caching=False, **kw)
    reqs = crowd(sched)
    out = drive(sched, worker)
    assert_reference(reqs, out.outputs)
    stats = sched.stats()
    assert stats.preemptions > 0 and stats.host_swaps_out == stats.host_swaps_in == 0
    resumed = [ns for p in worker.plans for ns in p.new_seqs][len(reqs):]
    assert resumed and all(ns.num_computed == 0 for ns in resumed)


def test_a_swapped_sequence_that_is_aborted_gives_its_slots_back():
    sched, worker = setup(overlap=False, enable_prefix_caching=False)
    crowd(sched)
    tier = sched.state.kv_tier
    while not tier.swapped:
        sched.process_result(worker.execute(sched.schedule()))
    [sid] = tier.swapped
    assert tier.host.num_used == len(tier.swapped[sid].host_slots)
    sched.abort([sid])
    assert not tier.swapped
    drive(sched, worker)
    stats = sched.stats()
    assert tier.host.num_used == 0 and stats.host_swaps_in == stats.host_swaps_out - 1


@pytest.mark.parametrize("overlap", [True, False])
def test_speculating_sequences_swap_only_without_proposals_in_flight(overlap):
    from fake_worker import Collector
    from spec_fake_worker import SpecFakeWorker, drive_spec
    from test_sched_spec_overlap import MAX_LEN, expected, random_accept, workload

    reqs = workload(7)
    cfg = SchedulerConfig(14, BS, max_num_seqs=8, max_num_batched_tokens=24,
                          max_model_len=MAX_LEN, overlap=overlap, num_speculative_tokens=3,
                          num_host_slots=64)
    sched = Scheduler(cfg)
    worker = SpecFakeWorker(14, BS, MAX_LEN, random_accept(7))
    swapped_with_proposals = []  # at every swap-out, the sequence's proposals in flight
    sched.state.kv_tier.swapped = _Recording(
        lambda sid: swapped_with_proposals.append(sched.seqs[sid].spec_inflight))
    for r in reqs:
        sched.add_request(r)
    out = drive_spec(sched, worker, Collector()).outputs
    assert {rid: (o.token_ids, o.finish_reason) for rid, o in out.items()} == expected(reqs)
    stats = sched.stats()
    assert stats.preemptions > 0 and stats.spec_accepted_tokens > 0
    assert not any(swapped_with_proposals)
    if not overlap:  # nothing is ever in flight at planning time: every long victim swaps
        assert stats.host_swaps_out > 0 and stats.host_swaps_in > 0


class _Recording(dict):
    """A dict that tells on_set each key set."""

    def __init__(self, on_set) -> None:
        super().__init__()
        self._on_set = on_set

    def __setitem__(self, key, value) -> None:
        self._on_set(key)
        super().__setitem__(key, value)


@pytest.mark.parametrize("host_slots", [3, 8, 64])
@pytest.mark.parametrize("caching", [False, True])
@pytest.mark.parametrize("mode", ["off", "overlap", "two ahead", "speculating"])
def test_mixed_workloads_swap_recompute_and_hit_with_reference_tokens(mode, caching, host_slots):
    """Shared prefixes, EOS, chunked prefill and a 14-block pool, with host pools too small
    for some swaps: every output is the reference, and every swap's slots come back."""
    from fake_worker import Collector
    from spec_fake_worker import SpecFakeWorker, drive_spec
    from test_sched_spec_overlap import MAX_LEN, expected, random_accept, workload

    swaps = 0
    for seed in range(3):
        reqs = workload(seed)
        k = 2 if mode == "speculating" else 0
        cfg = SchedulerConfig(14, BS, max_num_seqs=8, max_num_batched_tokens=24,
                              max_model_len=MAX_LEN, overlap=mode != "off",
                              plans_ahead=2 if mode == "two ahead" else 1,
                              enable_prefix_caching=caching, num_host_slots=host_slots,
                              num_speculative_tokens=k)
        sched = Scheduler(cfg)
        worker = (SpecFakeWorker(14, BS, MAX_LEN, random_accept(seed)) if k
                  else FakeWorker(14, BS))
        worker.poison_dropped = not caching
        for r in reqs:
            sched.add_request(r)
        out = (drive_spec(sched, worker, Collector()) if k else drive(sched, worker)).outputs
        assert {rid: (o.token_ids, o.finish_reason) for rid, o in out.items()} == expected(reqs)
        tier = sched.state.kv_tier
        assert not tier.swapped and (caching or tier.host.num_used == 0)
        swaps += sched.stats().host_swaps_in
    assert swaps > 0
