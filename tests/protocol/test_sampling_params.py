from __future__ import annotations

import math

import pytest

from protocol import SamplingParams, SamplingParamsError


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": math.nan}, "temperature"),
        ({"temperature": math.inf}, "temperature"),
        ({"temperature": "hot"}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_p": math.nan}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"top_k": 2.5}, "top_k"),
        ({"min_p": -0.1}, "min_p"),
        ({"min_p": 1.1}, "min_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": -5}, "max_tokens"),
        ({"max_tokens": True}, "max_tokens"),
        ({"seed": -1}, "seed"),
        ({"seed": 1.5}, "seed"),
        ({"stop": [""]}, "stop"),
        ({"stop": ["ok", 3]}, "stop"),
        ({"stop": "abc"}, "stop"),
        ({"stop": ["x"] * 100}, "stop"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"stop_token_ids": ["a"]}, "stop_token_ids"),
    ],
)
def test_out_of_range_values_name_the_field(kwargs, field):
    with pytest.raises(SamplingParamsError, match=field):
        SamplingParams(**kwargs)


def test_defaults_and_greedy():
    assert not SamplingParams().greedy
    assert SamplingParams(temperature=0).greedy
    assert SamplingParams(top_k=-1).top_k == -1
    assert SamplingParams(top_k=0).top_k == 0
    assert SamplingParams(seed=0, stop=["a"], stop_token_ids=[0]).seed == 0
    assert SamplingParams(max_tokens=None).max_tokens is None  # until the context is full
