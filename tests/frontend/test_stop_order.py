"""The order a pipeline stops its children in: what feeds the workers first, then decode
replicas' workers (they map the prefill workers' KV pools), then the other workers."""

from __future__ import annotations

from frontend.engine.children import Child, stop_order


def _child(role: str, rank: int = 0, replica: int | None = None) -> Child:
    return Child(role, rank, f"{role}.module", proc=None, replica=replica)


def _names(groups: list[list[Child]]) -> list[list[str]]:
    return [[c.name for c in group] for group in groups]


def test_decode_workers_stop_before_prefill_workers_after_every_feeder():
    children = [_child("worker", r, replica=i) for i in (0, 1, 2) for r in (0, 1)]
    children += [_child("tokenizer"), _child("detokenizer"),
                 _child("scheduler", replica=0), _child("scheduler", replica=1),
                 _child("scheduler", replica=2)]
    feeders, decode, rest = stop_order(children, ("prefill", "decode", "decode"))
    assert {c.role for c in feeders} == {"tokenizer", "detokenizer", "scheduler"}
    assert len(feeders) == 5
    assert [(c.replica, c.rank) for c in decode] == [(1, 0), (1, 1), (2, 0), (2, 1)]
    assert [(c.replica, c.rank) for c in rest] == [(0, 0), (0, 1)]


def test_without_disaggregation_the_workers_stop_together_after_the_feeders():
    children = [_child("scheduler"), _child("worker", 0), _child("worker", 1),
                _child("tokenizer")]
    assert _names(stop_order(children, ("",))) == [
        ["scheduler 0", "tokenizer 0"], [], ["worker 0", "worker 1"]]
    replicas = [_child("worker", 0, replica=0), _child("worker", 0, replica=1)]
    assert _names(stop_order(replicas, ("", ""))) == [
        [], [], ["replica 0 worker 0", "replica 1 worker 0"]]
