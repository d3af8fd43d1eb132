"""partition_heads (protocol.head_partition): the exact shards of each rank, and one-line
errors for sizes that cannot run."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from protocol.head_partition import even_split, partition_from_hf_config, partition_heads


def _shards(num_heads: int, num_kv_heads: int, tp: int) -> list[tuple[range, range]]:
    return [(s.q_heads, s.kv_heads) for s in partition_heads(num_heads, num_kv_heads, tp)]


R = range


@pytest.mark.parametrize("heads, kv, tp, expected", [
    (9, 3, 1, [(R(0, 9), R(0, 3))]),
    # SmolLM2-135M at TP=2: whole KV groups, the first rank takes the extra one.
    (9, 3, 2, [(R(0, 6), R(0, 2)), (R(6, 9), R(2, 3))]),
    (9, 3, 3, [(R(0, 3), R(0, 1)), (R(3, 6), R(1, 2)), (R(6, 9), R(2, 3))]),
    # TP above the KV heads: KV head 0 is replicated on ranks 0 and 1, which split its queries.
    (9, 3, 4, [(R(0, 2), R(0, 1)), (R(2, 3), R(0, 1)), (R(3, 6), R(1, 2)), (R(6, 9), R(2, 3))]),
    (9, 3, 9, [(R(h, h + 1), R(h // 3, h // 3 + 1)) for h in range(9)]),
    (6, 3, 2, [(R(0, 4), R(0, 2)), (R(4, 6), R(2, 3))]),
    (6, 3, 4, [(R(0, 1), R(0, 1)), (R(1, 2), R(0, 1)), (R(2, 4), R(1, 2)), (R(4, 6), R(2, 3))]),
    (6, 3, 5, [(R(0, 1), R(0, 1)), (R(1, 2), R(0, 1)), (R(2, 3), R(1, 2)), (R(3, 4), R(1, 2)),
               (R(4, 6), R(2, 3))]),
    (4, 2, 2, [(R(0, 2), R(0, 1)), (R(2, 4), R(1, 2))]),
    (8, 8, 3, [(R(0, 3), R(0, 3)), (R(3, 6), R(3, 6)), (R(6, 8), R(6, 8))]),  # no GQA
    (8, 1, 3, [(R(0, 3), R(0, 1)), (R(3, 6), R(0, 1)), (R(6, 8), R(0, 1))]),  # MQA
    (32, 8, 3, [(R(0, 12), R(0, 3)), (R(12, 24), R(3, 6)), (R(24, 32), R(6, 8))]),
])  # fmt: skip
def test_exact_shards(heads, kv, tp, expected):
    assert _shards(heads, kv, tp) == expected


@given(st.integers(1, 8), st.integers(1, 8), st.data())
def test_every_query_head_once_with_its_own_kv_head(kv, group, data):
    heads = kv * group
    tp = data.draw(st.integers(1, heads))
    shards = partition_heads(heads, kv, tp)
    assert len(shards) == tp
    assert [h for s in shards for h in s.q_heads] == list(range(heads))
    for s in shards:
        assert s.num_heads >= 1 and s.num_kv_heads >= 1
        assert {h // group for h in s.q_heads} == set(s.kv_heads)  # whole groups or one shared
        assert s.num_heads % s.num_kv_heads == 0  # what the attention kernels need
    sizes = [s.num_heads for s in shards]
    if tp <= kv or tp % kv == 0:  # balanced whenever the heads allow
        assert max(sizes) - min(sizes) <= (group if tp <= kv else 1)


@pytest.mark.parametrize("tp", [0, -1, 10, 64])
def test_unrunnable_tp_sizes_are_one_line_errors(tp):
    with pytest.raises(ValueError, match=r"tensor-parallel size must be between 1 and the "
                                         r"model's 9 attention heads, got -?\d+$") as err:
        partition_heads(9, 3, tp)
    assert "\n" not in str(err.value)


def test_kv_heads_must_divide_heads():
    with pytest.raises(ValueError, match=r"num_attention_heads \(9\) must be a positive multiple "
                                         r"of num_key_value_heads \(4\)"):
        partition_heads(9, 4, 1)


def test_from_hf_config_reads_the_head_counts():
    cfg = {"num_attention_heads": 9, "num_key_value_heads": 3, "hidden_size": 576}
    assert partition_from_hf_config(cfg, 2) == partition_heads(9, 3, 2)
    assert partition_from_hf_config({"num_attention_heads": 4}, 4) == partition_heads(4, 4, 4)


def test_even_split():
    assert even_split(1536, 4) == [R(0, 384), R(384, 768), R(768, 1152), R(1152, 1536)]
    assert even_split(98, 3) == [R(0, 33), R(33, 66), R(66, 98)]
    assert even_split(2, 3) == [R(0, 1), R(1, 2), R(2, 2)]
