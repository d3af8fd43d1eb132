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
        ({"stop": ""}, "stop"),
        ({"stop": ["x"] * 100}, "stop"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"stop_token_ids": ["a"]}, "stop_token_ids"),
        # Bounded by the worker column each value is stored in.
        ({"top_k": 2**31}, "top_k"),
        ({"max_tokens": 2**31}, "max_tokens"),
        ({"max_tokens": 2**64}, "max_tokens"),
        ({"seed": 2**63}, "seed"),
        ({"stop_token_ids": [2**31]}, "stop_token_ids"),
        ({"top_p": 1e-300}, "top_p"),
        ({"temperature": 1e-300}, "temperature"),
        ({"temperature": 1e39}, "temperature"),
        ({"temperature": 10**400}, "temperature"),
        ({"repetition_penalty": 1e-300}, "repetition_penalty"),
        ({"repetition_penalty": 1e300}, "repetition_penalty"),
        ({"n": 0}, "n"), ({"n": 1025}, "n"), ({"n": 2.0}, "n"),
        ({"logprobs": 5}, "logprobs"),  # vLLM's meaning; refused when made, not in the engine
        ({"ignore_eos": "yes"}, "ignore_eos"),
        ({"skip_special_tokens": None}, "skip_special_tokens"),
    ],
)
def test_out_of_range_values_name_the_field(kwargs, field):
    with pytest.raises(SamplingParamsError, match=field) as info:
        SamplingParams(**kwargs)
    assert info.value.field == field


def test_defaults_and_greedy():
    assert not SamplingParams().greedy
    assert SamplingParams(temperature=0).greedy
    assert SamplingParams(top_k=-1).top_k == -1
    assert SamplingParams(top_k=0).top_k == 0
    assert SamplingParams(seed=0, stop=["a"], stop_token_ids=[0]).seed == 0
    assert SamplingParams(max_tokens=None).max_tokens is None  # until the context is full


def test_the_largest_accepted_values_fit_the_worker_columns():
    """Every bound is what its column holds: the mirror stores the extremes unchanged."""
    from gpu_workers.sequence_table import SequenceTable
    from protocol import CachedSequences, NewSequence, StepPlan
    from protocol.sampling_params import (
        MAX_SEED,
        MAX_TOP_K,
        MIN_REPETITION_PENALTY,
        MIN_TEMPERATURE,
        MIN_TOP_P,
    )

    table = SequenceTable(2, 8, 2)
    params = SamplingParams(top_k=MAX_TOP_K, seed=MAX_SEED, top_p=MIN_TOP_P,
                            temperature=MIN_TEMPERATURE, repetition_penalty=MIN_REPETITION_PENALTY)
    table.apply(StepPlan(0, [], [NewSequence(1, [2**31 - 1], 1, 0, 1, [0], params)],
                         CachedSequences([], [], [])))
    row = table.rows[1]
    assert table.new_failures == []
    assert (table.top_k[row], table.seed[row]) == (MAX_TOP_K, MAX_SEED)
    assert table.top_p[row] > 0 and table.temperature[row] > 0 and table.repetition[row] > 0


def test_logprobs_as_a_count_points_to_top_logprobs():
    with pytest.raises(SamplingParamsError, match="logprobs=True, top_logprobs=N"):
        SamplingParams(logprobs=5)


def test_one_stop_string_may_be_given_as_it_is():
    assert SamplingParams(stop="abc") == SamplingParams(stop=["abc"])


def test_none_means_no_stop_strings_and_no_stop_tokens():
    # OpenAI's `"stop": null` and vLLM's `stop=None`: nothing stops the request early.
    params = SamplingParams(stop=None, stop_token_ids=None)
    assert params == SamplingParams()
    assert params.stop == [] and params.stop_token_ids == []
    with pytest.raises(SamplingParamsError, match="stop"):
        SamplingParams(stop=[None])  # an item still has to be a string
