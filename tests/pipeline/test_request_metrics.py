"""Per-request metrics as a user reads them from a real tiny CPU pipeline: on every final
output of the client library (stop strings included) and in LLM.generate's results."""

from __future__ import annotations

import dataclasses
import time

import pytest
from pipeline_config import tiny_engine

from frontend import LLM, Client
from frontend.engine.config import EngineConfig
from frontend.engine.pipeline import Pipeline
from protocol import FinishReason, RequestMetrics, SamplingParams

SHARED = [(7 * i + 3) % 200 + 10 for i in range(64)]  # four full blocks of 16 on cpu
PARAMS = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def pipeline(tiny_qwen3_dir):
    with Pipeline(EngineConfig(**tiny_engine(tiny_qwen3_dir, log_stats_interval=0))) as p:
        yield p


def assert_ordered(m: RequestMetrics, sent: float, received: float, generated: int) -> None:
    """The timeline of one request, on the wall clock of the test around it."""
    assert sent <= m.arrival_time <= m.first_scheduled_time <= m.first_token_time
    assert m.first_token_time <= m.finished_time <= received
    assert m.queue_time_s >= 0 and m.ttft_s > 0 and m.e2e_s >= m.ttft_s
    assert m.generated_tokens == generated
    if generated > 1:
        assert 0 < m.tpot_s and m.ttft_s + (generated - 1) * m.tpot_s <= m.e2e_s + 1e-6


def test_a_shared_prefix_is_reported_cached_and_timings_are_ordered(pipeline):
    with Client(pipeline.address) as client:
        sent = time.time()
        first = client.generate(prompt_token_ids=SHARED + [5, 6, 7], params=PARAMS)
        second = client.generate(prompt_token_ids=SHARED + [8, 9], params=PARAMS)
        received = time.time()
    assert first.metrics.cached_prompt_tokens == 0
    assert second.metrics.cached_prompt_tokens == len(SHARED)  # whole blocks, not the tail
    for out in (first, second):
        assert out.metrics.prompt_tokens == out.prompt_tokens
        assert out.metrics.finish_reason is FinishReason.LENGTH
        assert out.metrics.preemptions == 0
        assert_ordered(out.metrics, sent, received, len(out.token_ids))


def test_streamed_and_stop_string_requests_end_with_metrics(pipeline):
    with Client(pipeline.address) as client:
        probe = client.generate(prompt_token_ids=SHARED[:20], params=SamplingParams(
            temperature=0, max_tokens=16, ignore_eos=True))
        stop = probe.text.strip()[len(probe.text.strip()) // 2:][:2]
        assert stop, f"no text to stop at: {probe.text!r}"
        sent = time.time()
        stopped = client.generate(prompt_token_ids=SHARED[:20], params=SamplingParams(
            temperature=0, max_tokens=16, ignore_eos=True, stop=[stop]))
        deltas = list(client.stream(prompt_token_ids=SHARED[:20], params=PARAMS))
        received = time.time()
    # The detokenizer ends a stop-string request; its metrics still come from the scheduler.
    assert stopped.finish_reason == "stop" and stopped.metrics is not None
    assert stopped.metrics.finish_reason is FinishReason.STOP
    assert_ordered(stopped.metrics, sent, received, stopped.metrics.generated_tokens)
    assert all(d.metrics is None for d in deltas[:-1])
    assert deltas[-1].finish_reason == "length"
    assert_ordered(deltas[-1].metrics, sent, received, 6)


def test_a_stop_string_in_the_last_token_reports_stop_in_the_metrics_too(pipeline):
    """The scheduler ends the request at max_tokens in the very step whose text holds the stop
    string: the user sees "stop", and the metrics must not say "length"."""
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    with Client(pipeline.address) as client:
        probe = client.generate(prompt_token_ids=SHARED[:24], params=params)
        shorter = client.generate(prompt_token_ids=SHARED[:24], params=dataclasses.replace(
            params, max_tokens=11))
        assert probe.text.startswith(shorter.text) and len(probe.text) > len(shorter.text)
        # The shortest tail of the text, reaching into the last token, found nowhere earlier.
        tail = next(probe.text[i:] for i in range(len(shorter.text), -1, -1)
                    if probe.text.find(probe.text[i:]) == i)
        stopped = client.generate(prompt_token_ids=SHARED[:24], params=dataclasses.replace(
            params, stop=[tail]))
    assert stopped.finish_reason == "stop"
    assert stopped.metrics.finish_reason is FinishReason.STOP


def test_llm_generate_results_carry_metrics(tiny_qwen3_dir):
    with LLM(**tiny_engine(tiny_qwen3_dir)) as llm:
        sent = time.time()
        results = llm.generate([SHARED + [1], SHARED + [2]], PARAMS, use_tqdm=False)
        received = time.time()
    for r in results:
        assert isinstance(r["metrics"], RequestMetrics)
        assert_ordered(r["metrics"], sent, received, len(r["token_ids"]))
    # Submitted together: whichever is admitted second may or may not find the first's
    # blocks hashed yet, but both counted their prompts.
    assert [r["metrics"].prompt_tokens for r in results] == [65, 65]
