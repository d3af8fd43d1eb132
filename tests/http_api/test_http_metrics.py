"""Request metrics and Prometheus metrics over HTTP, on a real tiny CPU pipeline: usage's
cached_tokens and timings (whole and streamed), and /metrics scraped and parsed the way
Prometheus would."""

from __future__ import annotations

import contextlib
import json
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from http_serving import running_server
from prometheus_client.parser import text_string_to_metric_families

from frontend import AsyncClient
from frontend.client.outputs import RequestOutput
from frontend.engine.config import EngineConfig
from frontend.engine.pipeline import Pipeline
from frontend.metrics import follow
from frontend.openai_server.app import create_app
from frontend.openai_server.responses import CompletionFormat
from protocol import FinishReason, RequestMetrics

ROOT = Path(__file__).resolve().parents[2]
ENGINE = dict(device="cpu", dtype="float32", max_model_len=256, max_num_seqs=16,
              max_num_batched_tokens=512, log_stats_interval=0)
SHARED = [(7 * i + 3) % 200 + 10 for i in range(48)]  # three full blocks of 16 on cpu
BODY = {"temperature": 0, "max_tokens": 5, "ignore_eos": True}
HISTOGRAMS = ("time_to_first_token_seconds", "time_per_output_token_seconds",
              "e2e_request_latency_seconds", "request_queue_time_seconds")


@pytest.fixture(scope="module")
def pipeline(tiny_qwen3_dir):
    with Pipeline(EngineConfig(model=tiny_qwen3_dir, **ENGINE)) as pipeline:
        yield pipeline


@pytest.fixture(scope="module")
def base_url(pipeline):
    metrics, subscriber = follow(pipeline.endpoints.deltas_pub, pipeline.endpoints.keys)

    @contextlib.asynccontextmanager
    async def make_app():
        async with AsyncClient(pipeline.address) as client:
            yield create_app(client, client.welcome.model, metrics=metrics)

    try:
        with running_server(make_app) as url:
            yield url
    finally:
        subscriber.close()


def scrape(base_url: str) -> dict[str, float]:
    """Every sample of /metrics by name (and labels), parsed as Prometheus parses it."""
    r = httpx.get(base_url + "/metrics", timeout=30)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    samples = {}
    for family in text_string_to_metric_families(r.text):
        for s in family.samples:
            if s.name.endswith("_created"):
                continue
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k != "le")
            key = s.name + (f"{{{labels}}}" if labels else "")
            if "le" in s.labels:
                key += f"[le={s.labels['le']}]"
            samples[key] = s.value
    return samples


def finished(samples: dict[str, float]) -> float:
    return sum(v for k, v in samples.items()
               if k.startswith("nanopipe:requests_finished_total"))


def wait_scrape(base_url: str, done, timeout: float = 20.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while not done(samples := scrape(base_url)):
        assert time.monotonic() < deadline, f"metrics never got there: {samples}"
        time.sleep(0.1)
    return samples


def settled(base_url: str) -> dict[str, float]:
    """A scrape once the stats of earlier requests have all arrived (they are published
    every half second): two scrapes a publication apart that agree, nothing running."""
    prev = scrape(base_url)
    while True:
        time.sleep(0.6)
        cur = scrape(base_url)
        if finished(cur) == finished(prev) and cur["nanopipe:num_requests_running"] == 0:
            return cur
        prev = cur


def complete(base_url: str, prompt: list[int], **extra) -> dict:
    r = httpx.post(base_url + "/v1/completions", timeout=60,
                   json={"prompt": prompt, **BODY, **extra})
    assert r.status_code == 200, r.text
    return r.json()


def test_usage_reports_cached_tokens_and_timings(base_url):
    first = complete(base_url, SHARED + [1, 2])["usage"]
    second = complete(base_url, SHARED + [3])["usage"]
    assert first["prompt_tokens_details"] == {"cached_tokens": 0}
    assert second["prompt_tokens_details"] == {"cached_tokens": len(SHARED)}
    for usage in (first, second):
        t = usage["nanopipe"]
        assert 0 <= t["queue_time_s"] <= t["ttft_s"] <= t["e2e_s"]
        assert t["tpot_s"] > 0 and t["preemptions"] == 0
        assert t["cached_tokens"] == usage["prompt_tokens_details"]["cached_tokens"]
        assert abs(t["arrival_time"] - time.time()) < 60


def test_streamed_usage_chunk_carries_the_metrics(base_url):
    with httpx.stream("POST", base_url + "/v1/chat/completions", timeout=60, json={
            "messages": [{"role": "user", "content": "hello there"}], "stream": True,
            "stream_options": {"include_usage": True}, **BODY}) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines()
                  if line.startswith("data: {")]
    assert all(e["usage"] is None for e in events[:-1])
    usage = events[-1]["usage"]
    assert usage["completion_tokens"] == 5
    assert "cached_tokens" in usage["prompt_tokens_details"]
    t = usage["nanopipe"]
    assert 0 <= t["queue_time_s"] <= t["ttft_s"] <= t["e2e_s"]


def test_metrics_endpoint_counts_what_the_requests_did(base_url):
    before = settled(base_url)
    n_before = finished(before)
    n = 3
    outs = [complete(base_url, SHARED + [40 + i]) for i in range(n)]
    after = wait_scrape(base_url, lambda s: finished(s) == n_before + n)
    delta = {k: after[k] - before.get(k, 0.0) for k in after}
    assert delta['nanopipe:requests_finished_total{finished_reason=length}'] == n
    assert delta["nanopipe:generation_tokens_total"] == sum(
        o["usage"]["completion_tokens"] for o in outs) == 5 * n
    assert delta["nanopipe:prompt_tokens_cached_total"] >= (n - 1) * len(SHARED)
    assert delta["nanopipe:engine_steps_total"] >= 5
    assert delta["nanopipe:gpu_busy_seconds_total"] > 0  # the worker's own step timing
    assert after["nanopipe:spec_proposed_tokens_total"] == 0  # no speculation here
    assert after["nanopipe:engine_steps_two_ahead_total"] == 0  # one plan ahead on a CPU
    for name in HISTOGRAMS:
        # Every request finished so far (this module's) is in each histogram, once.
        assert after[f"nanopipe:{name}_count"] == finished(after), name
        assert after[f"nanopipe:{name}_bucket[le=+Inf]"] == finished(after), name
        assert delta[f"nanopipe:{name}_count"] == n and delta[f"nanopipe:{name}_sum"] > 0
    assert after["nanopipe:num_requests_running"] == after["nanopipe:num_requests_waiting"] == 0
    assert after["nanopipe:kv_cache_usage_perc"] == 0
    assert 0 < after["nanopipe:prefix_cache_hit_rate"] < 1


def test_the_standalone_server_follows_an_ipc_pipelines_stats(pipeline):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    base = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen([sys.executable, "-m", "frontend.openai_server.server",
                             "--address", pipeline.address, "--port", str(port),
                             "--log-level", "warning"], cwd=ROOT)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(base + "/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                assert proc.poll() is None and time.monotonic() < deadline
                time.sleep(0.2)
        complete(base, SHARED + [99])
        # It follows from its start: this request is in its histograms, earlier ones not.
        got = wait_scrape(base, lambda s: s["nanopipe:e2e_request_latency_seconds_count"] == 1)
        assert got["nanopipe:time_to_first_token_seconds_count"] == 1
        assert finished(got) >= 1
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_n_choices_report_the_prompts_cache_once_and_each_choices_timings():
    def output(cached: int, ttft: float) -> RequestOutput:
        m = RequestMetrics(1.7e9, 0.001, ttft, 0.01, ttft + 0.04, 60, cached, 5, 0,
                           FinishReason.LENGTH)
        return RequestOutput("r", "text", [1, 2, 3, 4, 5], "length", 60, 5, None, metrics=m)

    two_prompts = CompletionFormat("tiny").response([output(0, 0.2), output(48, 0.05)])
    assert two_prompts["usage"]["prompt_tokens"] == 120  # a batch counts each prompt
    assert two_prompts["usage"]["prompt_tokens_details"] == {"cached_tokens": 48}
    body = CompletionFormat("tiny", choices_per_prompt=2).response(
        [output(0, 0.2), output(48, 0.05)])
    usage = body["usage"]
    assert (usage["prompt_tokens"], usage["completion_tokens"]) == (60, 10)
    assert usage["prompt_tokens_details"] == {"cached_tokens": 48}
    assert usage["nanopipe"]["ttft_s"] == 0.2  # the first choice's, and every choice's below
    assert [c["ttft_s"] for c in usage["nanopipe"]["choices"]] == [0.2, 0.05]
    assert [c["cached_tokens"] for c in usage["nanopipe"]["choices"]] == [0, 48]
