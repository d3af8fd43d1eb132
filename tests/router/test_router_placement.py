"""The router's decisions on their own: prefix affinity, load, round robin, dead replicas,
and the bounded prefix summary."""

from __future__ import annotations

import pytest

from frontend.router import Router, RouterConfig
from frontend.router.placement import REQUEST_COST
from frontend.router.prefix_summary import PrefixSummary, block_hashes
from protocol.engine_messages import EngineStats
from scheduler_proc.block_manager import hash_block

BS = 16


def config(n: int = 2, routing: str = "affinity", kv_blocks: int = 1024) -> RouterConfig:
    return RouterConfig(tuple(f"ipc://s{i}" for i in range(n)),
                        tuple(f"ipc://p{i}" for i in range(n)), block_size=BS,
                        kv_blocks=(kv_blocks,) * n, routing=routing)


def prompt(group: int, own: int, prefix_len: int = 128, own_len: int = 8) -> list[int]:
    return [1000 * group + i for i in range(prefix_len)] + [7 * own + j for j in range(own_len)]


def stats(t: float, prompt_tokens=0, cached=0, finished=0, running=0, waiting=0,
          used=0, total=100) -> EngineStats:
    return EngineStats(t, 0, prompt_tokens, cached, 0, 0, finished, 0.0, 0.0, running, waiting,
                       used, total)


def test_block_hashes_are_the_schedulers_chain():
    tokens = list(range(50))
    parent, expected = 0, []
    for start in range(0, 48, BS):
        parent = hash_block(parent, tokens[start:start + BS])
        expected.append(parent)
    assert block_hashes(tokens, BS) == expected  # the partial last block is not hashed


def test_shared_prefix_requests_follow_the_first_and_groups_spread():
    router = Router(config())
    placed = {(g, i): router.place(prompt(g, i)) for i in range(4) for g in (0, 1)}
    for g in (0, 1):
        assert len({placed[(g, i)].replica for i in range(4)}) == 1
    assert placed[(0, 0)].replica != placed[(1, 0)].replica
    assert placed[(0, 0)].matched_tokens == 0
    assert placed[(0, 3)].matched_tokens == 128


def test_load_outweighs_a_small_prefix_hit():
    router = Router(config())
    first = router.place(prompt(0, 0, prefix_len=16)).replica
    # Ten unrelated requests still running on `first` make a one-block hit not worth waiting.
    router.loads[first].placed_requests += 10
    assert router.place(prompt(0, 1, prefix_len=16)).replica != first


def test_stats_retire_finished_work():
    router = Router(config())
    a = router.place(prompt(0, 0)).replica
    busy = router.loads[a].work_ahead()
    assert busy == 136 + REQUEST_COST
    router.on_stats(a, stats(1.0, prompt_tokens=136, finished=1))
    assert router.loads[a].work_ahead() == 0
    router.on_stats(a, stats(0.5, prompt_tokens=0, finished=0))  # older: ignored
    assert router.loads[a].work_ahead() == 0


def test_nearly_full_kv_pool_sends_requests_elsewhere():
    router = Router(config())
    a = router.place(prompt(0, 0)).replica
    router.on_stats(a, stats(1.0, prompt_tokens=136, finished=1, used=97, total=100))
    assert router.place(prompt(0, 1)).replica != a


def test_round_robin_takes_turns_whatever_the_prefix():
    router = Router(config(3, routing="round_robin"))
    assert [router.place(prompt(0, i)).replica for i in range(6)] == [0, 1, 2, 0, 1, 2]


def test_dead_replicas_get_nothing_and_none_alive_is_an_error():
    router = Router(config())
    router.mark_dead(0)
    assert {router.place(prompt(g, 0)).replica for g in range(4)} == {1}
    router.mark_dead(1)
    with pytest.raises(LookupError, match="no data-parallel replica"):
        router.place(prompt(0, 0))


def test_summary_is_bounded_by_the_replicas_pool_least_recent_first():
    summary = PrefixSummary(capacity=4)
    old, new = block_hashes(prompt(0, 0), BS)[:3], block_hashes(prompt(1, 0), BS)[:3]
    summary.add(old)
    summary.add(new)
    assert len(summary) == 4 and summary.compact_bytes == 32
    assert summary.matched_blocks(new) == 3
    assert summary.matched_blocks(old) == 0  # its first block went first


def test_bad_router_config_names_the_field():
    with pytest.raises(ValueError, match="routing"):
        config(routing="random")
    with pytest.raises(ValueError, match="per replica"):
        RouterConfig(("a", "b"), ("c",), block_size=BS, kv_blocks=(1, 1))


def test_a_burst_of_four_groups_keeps_each_group_on_one_replica_and_splits_the_load():
    """W3 traffic as bench_dp.py sends it: the first request of each group, then the rest of
    every group at once, group after group (no stats in between). The expected prefix hit is
    not counted as work ahead, so a long shared prefix keeps its group together."""
    router = Router(config())
    where = {g: {router.place(prompt(g, 0, prefix_len=192, own_len=20)).replica}
             for g in range(4)}
    for g in range(4):
        for i in range(1, 8):
            where[g].add(router.place(prompt(g, i, prefix_len=192, own_len=20)).replica)
    assert all(len(replicas) == 1 for replicas in where.values()), where
    assert sorted(r for (r,) in where.values()) == [0, 0, 1, 1]
