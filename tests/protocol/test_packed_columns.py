"""Token ids and block tables travel as packed int32, and a SamplingParams shared by many new
sequences travels once per frame: what a prefill plan and an AddRequest look like on the wire,
and how the decoders refuse frames that misuse either (or the decode plan's block rows)."""

from __future__ import annotations

import struct
from array import array

import msgpack
import pytest

import protocol as p

PARAMS = p.SamplingParams(temperature=0.6, max_tokens=64, stop_token_ids=[2])
GREEDY = p.SamplingParams(temperature=0.0, max_tokens=8)
PLAN_DECODER = p.Decoder(p.StepPlan)


def prefill_plan(params: list[p.SamplingParams]) -> p.StepPlan:
    seqs = [p.NewSequence(10 + i, [5, 151_935, 2**31 - 1, 0], 4, 0, 4, [i, 7], sp)
            for i, sp in enumerate(params)]
    return p.StepPlan(3, [], seqs, p.CachedSequences([], [], []))


def raw_new_seqs(plan: p.StepPlan) -> list:
    return msgpack.unpackb(p.encode(plan))[3]


def with_new_seq_field(plan: p.StepPlan, index: int, value) -> bytes:
    raw = msgpack.unpackb(p.encode(plan))
    raw[3][0][index] = value
    return msgpack.packb(raw, use_bin_type=True)


def test_a_prefill_plan_round_trips_with_int32_arrays():
    plan = prefill_plan([PARAMS, PARAMS])
    got = PLAN_DECODER.decode(p.encode(plan))
    assert got == plan
    first = got.new_seqs[0]
    assert type(first.token_ids) is array and first.token_ids.typecode == "i"
    assert first.token_ids.tolist() == [5, 151_935, 2**31 - 1, 0]
    assert first.block_table.tolist() == [0, 7]


def test_token_ids_and_block_tables_are_one_little_endian_int32_bin_each():
    (entry,) = raw_new_seqs(prefill_plan([PARAMS]))
    assert entry[1] == struct.pack("<4i", 5, 151_935, 2**31 - 1, 0)
    assert entry[5] == struct.pack("<2i", 0, 7)


def test_messages_hold_arrays_whatever_they_were_built_from():
    req = p.AddRequest(1, (i for i in range(3)), GREEDY, [0])
    assert req.prompt_token_ids == array("i", [0, 1, 2])
    ids = array("i", [4, 5])
    assert p.AddRequest(2, ids, GREEDY, [0]).prompt_token_ids is ids  # no copy


@pytest.mark.parametrize("ids", [[1, 2**31], [-(2**31) - 1], [1.0], ["7"], b"\x01\x00\x00\x00"])
def test_token_ids_that_int32_cannot_hold_are_refused_where_the_message_is_made(ids):
    with pytest.raises(ValueError, match="int32|integers"):
        p.AddRequest(1, ids, GREEDY, [0])
    with pytest.raises(ValueError, match="int32|integers"):
        p.NewSequence(1, ids, 1, 0, 1, [0], GREEDY)


def test_the_int32_extremes_reach_the_scheduler_unchanged():
    req = p.AddRequest(1, [-(2**31), 2**31 - 1], GREEDY, [0])
    got = p.Decoder(p.AddRequest).decode(p.encode(req))
    assert got.prompt_token_ids.tolist() == [-(2**31), 2**31 - 1]


@pytest.mark.parametrize("value, match", [
    (b"\x01\x00\x00", "not a whole number of int32"),
    (b"\x01\x00\x00\x00\x02", "not a whole number of int32"),
    ([5, 6, 7], "packed as bytes, got list"),
    ("abcd", "packed as bytes, got str"),
    (None, "packed as bytes, got NoneType"),
])
def test_a_malformed_token_bin_is_a_clear_decode_error(value, match):
    frame = with_new_seq_field(prefill_plan([PARAMS]), 1, value)
    with pytest.raises(p.ProtocolError, match=f"NewSequence.token_ids: .*{match}"):
        PLAN_DECODER.decode(frame)


def test_a_malformed_prompt_bin_is_a_clear_decode_error():
    raw = msgpack.unpackb(p.encode(p.AddRequest(1, [1, 2], GREEDY, [0])))
    raw[2] = raw[2][:-1]
    with pytest.raises(p.ProtocolError, match="AddRequest.prompt_token_ids: 7 bytes"):
        p.Decoder(p.AddRequest).decode(msgpack.packb(raw, use_bin_type=True))


def test_shared_params_travel_once_then_as_references():
    # Equal params that are distinct objects (each request decoded its own) go once too.
    twin = p.SamplingParams(temperature=0.6, max_tokens=64, stop_token_ids=[2])
    plan = prefill_plan([PARAMS, GREEDY, twin, PARAMS, GREEDY])
    entries = raw_new_seqs(plan)
    assert [type(e[6]) for e in entries] == [list, list, int, int, int]
    assert [e[6] for e in entries[2:]] == [0, 0, 1]
    got = PLAN_DECODER.decode(p.encode(plan))
    assert got == plan
    params = [s.params for s in got.new_seqs]
    assert params[0] is params[2] is params[3] and params[1] is params[4]


@pytest.mark.parametrize("ref", [1, -1, 2**63, True])
def test_a_reference_to_no_earlier_params_is_refused(ref):
    plan = prefill_plan([PARAMS, PARAMS])
    raw = msgpack.unpackb(p.encode(plan))
    raw[3][1][6] = ref
    with pytest.raises(p.ProtocolError, match="NewSequence.params"):
        PLAN_DECODER.decode(msgpack.packb(raw, use_bin_type=True))


def test_a_reference_before_any_params_is_refused():
    frame = with_new_seq_field(prefill_plan([PARAMS]), 6, 0)
    with pytest.raises(p.ProtocolError, match="refers to no earlier SamplingParams"):
        PLAN_DECODER.decode(frame)


def test_params_sent_in_full_are_checked_each_time():
    raw = msgpack.unpackb(p.encode(prefill_plan([PARAMS, GREEDY])))
    raw[3][1][6][0] = -1.0  # the second entry's temperature
    with pytest.raises(p.ProtocolError, match="temperature"):
        PLAN_DECODER.decode(msgpack.packb(raw, use_bin_type=True))


@pytest.mark.parametrize("rows", [[[], 5], [[], [1, "2"]], [[], [True]], [[], None], "[]"])
def test_malformed_new_block_rows_are_refused(rows):
    raw = msgpack.unpackb(p.encode(p.StepPlan(0, [], [], p.CachedSequences([1, 2], [1, 1],
                                                                           [[], [9]]))))
    raw[4][2] = rows
    with pytest.raises(p.ProtocolError, match="CachedSequences.new_block_ids: expected a list"):
        PLAN_DECODER.decode(msgpack.packb(raw, use_bin_type=True))
