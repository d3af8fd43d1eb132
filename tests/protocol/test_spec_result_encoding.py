"""StepResult's speculative columns on the wire: num_proposed is sent only when some entry
verified proposals (a list of zeros is stored as None), and both spellings decode alike."""

from __future__ import annotations

import dataclasses

import msgpack

from protocol import Decoder, StepResult, encode


def spec_result(num_tokens: list[int], num_proposed: list[int] | None) -> StepResult:
    ids = list(range(1_000_000, 1_000_000 + len(num_tokens)))
    tokens = list(range(150_000, 150_000 + sum(num_tokens)))
    return StepResult(5, ids, tokens, None, num_tokens=num_tokens, num_proposed=num_proposed)


def test_a_speculative_result_round_trips():
    result = spec_result([3, 1, 5, 1], [4, 0, 4, 2])
    back = Decoder(StepResult).decode(encode(result))
    assert back == result
    assert back.num_tokens == [3, 1, 5, 1] and back.num_proposed == [4, 0, 4, 2]


def test_zero_proposals_travel_as_none_and_cost_no_byte_per_entry():
    entries = 256
    zeros = spec_result([1] * entries, [0] * entries)
    assert zeros.num_proposed is None
    frame = encode(zeros)
    names = [f.name for f in dataclasses.fields(StepResult)]
    values = [getattr(zeros, name) for name in names]
    values[names.index("num_proposed")] = [0] * entries  # how it travelled before
    with_list = msgpack.packb([0x21, *values])
    assert len(with_list) - len(frame) == entries + 2  # the list's header and one byte each
    back = Decoder(StepResult).decode(frame)
    assert back.num_tokens == [1] * entries and back.num_proposed is None


def test_an_old_frame_with_a_list_of_zeros_decodes_as_no_proposals():
    fields = [5, [7, 8], [100, 101], None, None, None, [], [], [1, 1], [0, 0], 0.25, [], []]
    back = Decoder(StepResult).decode(msgpack.packb([0x21, *fields]))
    assert back.num_tokens == [1, 1]
    assert back.num_proposed is None  # read as zero proposals per entry
    assert back.gpu_busy_s == 0.25


def test_absent_speculation_fields_decode_as_one_token_per_entry():
    fields = [5, [7, 8], [100, 101], None, None, None, [], [], None, None, 0.0, [], []]
    back = Decoder(StepResult).decode(msgpack.packb([0x21, *fields]))
    assert back.num_tokens is None and back.num_proposed is None
    assert back == StepResult(5, [7, 8], [100, 101], None)
