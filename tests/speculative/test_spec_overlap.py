"""Speculative decoding with the scheduler's overlap and the worker's lookahead: the real
Scheduler and ModelRunner in one process (tiny model, CPU float32). Plans go out before the
previous result says how many proposals were accepted; greedy output must still equal
decoding without speculation, step by step, token for token."""

from __future__ import annotations

import pytest
from spec_helpers import generate, greedy_requests

from protocol import AddRequest, FinishReason, SamplingParams

MODES = [pytest.param({"overlap": True}, id="overlap"),
         pytest.param({"lookahead": True}, id="lookahead")]


def _shared_heads(seed: int, n: int) -> list[AddRequest]:
    reqs = greedy_requests(seed, n=n)
    head = reqs[0].prompt_token_ids[:32]
    return [r if i % 2 else AddRequest(r.request_id, head + r.prompt_token_ids, r.params,
                                       r.eos_token_ids) for i, r in enumerate(reqs)]


@pytest.mark.parametrize("mode", MODES)
def test_ngram_greedy_equals_step_by_step_without_speculation(tiny_qwen3_dir, mode):
    """Prefix hits, chunked prefill (24-token budget) and preemption (14-block pool) at once;
    the pool invariants are checked after every result."""
    reqs = _shared_heads(5, 8)
    base, _, _ = generate(tiny_qwen3_dir, reqs)
    spec, sched, _ = generate(tiny_qwen3_dir, reqs, k=5, kv_bytes=14 * 16 * 512, budget=24,
                              **mode)
    assert spec == base
    stats = sched.stats()
    assert stats.preemptions > 0 and stats.cached_prompt_tokens > 0
    assert stats.spec_accepted_tokens > 0
    assert stats.kv_blocks_used == 0


@pytest.mark.parametrize("mode", MODES)
def test_draft_greedy_equals_step_by_step_without_speculation(tiny_qwen3_dir, mode):
    """The target as its own draft: stale draft KV (a catch-up that read a token still on
    the device) would show as rejections, so acceptance stays ~100%."""
    reqs = _shared_heads(5, 8)
    base, _, _ = generate(tiny_qwen3_dir, reqs)
    spec, sched, _ = generate(tiny_qwen3_dir, reqs, k=3, kv_bytes=14 * 16 * 1024, budget=24,
                              draft=tiny_qwen3_dir, **mode)
    assert spec == base
    stats = sched.stats()
    assert stats.preemptions > 0 and stats.cached_prompt_tokens > 0
    assert stats.spec_accepted_tokens / stats.spec_proposed_tokens > 0.97
    assert stats.kv_blocks_used == 0


@pytest.mark.parametrize("mode", MODES)
def test_max_tokens_max_model_len_and_stop_ids_are_never_overshot(tiny_qwen3_dir, mode):
    """Stops inside accepted runs, max_tokens a few tokens past a step's reach, and
    sequences that run into max_model_len: the outputs equal those without speculation (the
    collector refuses any delta after a finish, so nothing past a stop is streamed)."""
    reqs = greedy_requests(3, n=6)
    plain, _, _ = generate(tiny_qwen3_dir, reqs)
    cut = []
    for r in reqs:
        out = plain[r.request_id][0]
        stop = out[min(len(out) - 1, 5 + r.request_id)]
        params = SamplingParams(temperature=0.0, ignore_eos=True,  # None: up to max_model_len
                                max_tokens=None if r.request_id % 2 else 7 + r.request_id,
                                stop_token_ids=[stop] if r.request_id % 3 == 0 else [])
        cut.append(AddRequest(r.request_id, r.prompt_token_ids, params, r.eos_token_ids))
    base, _, _ = generate(tiny_qwen3_dir, cut, max_model_len=56)
    spec, sched, _ = generate(tiny_qwen3_dir, cut, k=6, max_model_len=56, **mode)
    assert spec == base
    reasons = {reason for _, reason in spec.values()}
    assert FinishReason.STOP in reasons and FinishReason.LENGTH in reasons
    assert any(len(r.prompt_token_ids) + len(spec[r.request_id][0]) == 56 for r in cut)
    assert sched.stats().spec_accepted_tokens > 0


@pytest.mark.parametrize("mode", MODES)
def test_abort_mid_flight_frees_everything(tiny_qwen3_dir, mode):
    """Aborts while plans with proposals are in flight: the other requests' tokens do not
    change, every block comes back, and no later result resurrects the aborted ones."""
    reqs = greedy_requests(7, n=6)
    base, _, _ = generate(tiny_qwen3_dir, reqs)

    def hook(sched, step):
        if step in (4, 9):
            victim = next((s for s in sched.running if s.spec_inflight), None)
            if victim is not None:
                sched.abort([victim.seq_id])
                aborted.append(victim.seq_id)

    aborted: list[int] = []
    spec, sched, _ = generate(tiny_qwen3_dir, reqs, k=4, hook=hook, **mode)
    assert aborted
    for rid, (tokens, reason) in spec.items():
        if rid in aborted:
            assert reason is FinishReason.ABORT
            assert tokens == base[rid][0][:len(tokens)]
        else:
            assert (tokens, reason) == base[rid]
    assert sched.stats().kv_blocks_used == 0


@pytest.mark.parametrize("proposer", ["ngram", "draft"])
def test_lookahead_proposes_what_overlap_alone_proposes(tiny_qwen3_dir, proposer):
    """The scheduler sends the same plans either way, so a worker that launches a plan while
    the step before it is still unsettled must propose the same tokens as one that waited:
    a proposer reading the history on the host (n-gram lookup, the draft's catch-up) needs
    the token still on the device, so such a step settles the one in flight first."""
    reqs = greedy_requests(2, n=5)
    draft = tiny_qwen3_dir if proposer == "draft" else None
    runs = [generate(tiny_qwen3_dir, reqs, k=4, draft=draft, **mode)
            for mode in ({"overlap": True}, {"lookahead": True})]
    (over, over_sched, _), (ahead, ahead_sched, _) = runs
    assert over == ahead
    counts = [(s.stats().spec_proposed_tokens, s.stats().spec_accepted_tokens)
              for s in (over_sched, ahead_sched)]
    assert counts[0] == counts[1] and counts[0][1] > 0
