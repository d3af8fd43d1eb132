"""The engine's stats as a user follows them on a live tiny CPU pipeline: the EngineStats
published on deltas_pub count exactly what the clients got, and the launcher's stats logger
turns them into lines."""

from __future__ import annotations

import signal
import subprocess
import threading
import time
from pathlib import Path

import zmq
from launcher_lines import LauncherLines
from pipeline_config import tiny_engine

from frontend import Client
from frontend.engine.config import EngineConfig
from frontend.engine.pipeline import Pipeline
from frontend.engine.stats_log import StatsLogger
from protocol import Decoder, SamplingParams
from protocol.engine_messages import ENGINE_STATS_TOPIC, EngineStats

ROOT = Path(__file__).resolve().parents[2]
SHARED = [(7 * i + 3) % 200 + 10 for i in range(32)]  # two full blocks of 16 on cpu
PARAMS = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


class StatsFollower:
    """Subscribes to the stats topic of deltas_pub and keeps the latest EngineStats."""

    def __init__(self, address: str) -> None:
        self.latest: EngineStats | None = None
        self._ctx = zmq.Context()
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.SUBSCRIBE, ENGINE_STATS_TOPIC)
        self._sub.connect(address)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        decoder = Decoder(EngineStats)  # the topic lets nothing else through
        while not self._stop.is_set():
            if self._sub.poll(50):
                self.latest = decoder.decode(self._sub.recv())

    def wait_for(self, done, timeout: float = 10.0) -> EngineStats:
        deadline = time.monotonic() + timeout
        while self.latest is None or not done(self.latest):
            assert time.monotonic() < deadline, f"stats never got there: {self.latest}"
            time.sleep(0.05)
        return self.latest

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self._sub.close(0)
        self._ctx.term()


def test_published_stats_count_what_the_clients_got(tiny_qwen3_dir):
    config = EngineConfig(**tiny_engine(tiny_qwen3_dir, log_stats_interval=0))
    lines: list[str] = []
    with Pipeline(config) as pipeline:
        follower = StatsFollower(pipeline.endpoints.deltas_pub)
        logger = StatsLogger(zmq.Context.instance(), pipeline.endpoints.deltas_pub, None, 0.5,
                             emit=lines.append)
        try:
            baseline = follower.wait_for(lambda s: True)
            assert (baseline.steps, baseline.generated_tokens, baseline.running) == (0, 0, 0)
            assert baseline.kv_blocks_total == pipeline.num_kv_blocks
            prompts = [SHARED + [5, 6, 7], SHARED + [8], SHARED + [9, 10]]
            with Client(pipeline.address) as client:
                first = client.generate(prompt_token_ids=prompts[0], params=PARAMS)
                rest = [client.generate(prompt_token_ids=p, params=PARAMS) for p in prompts[1:]]
            outs = [first, *rest]
            stats = follower.wait_for(lambda s: s.finished_requests == 3)
            assert stats.generated_tokens == sum(len(o.token_ids) for o in outs) == 18
            # The first computes its whole prompt; the others find the shared 32 cached.
            assert stats.cached_prompt_tokens == 2 * len(SHARED)
            assert stats.prompt_tokens == sum(map(len, prompts)) - 2 * len(SHARED)
            assert stats.preemptions == 0 and stats.steps >= 6
            assert (stats.running, stats.waiting, stats.kv_blocks_used) == (0, 0, 0)
            assert stats.schedule_time_s > 0 and stats.time_s > baseline.time_s
            deadline = time.monotonic() + 10
            while not any("gen tok/s" in line and not line.startswith("0.0 ")
                          for line in lines):
                assert time.monotonic() < deadline, f"no busy stats line: {lines}"
                time.sleep(0.05)
            assert "prefix hits" in lines[-1] and "preemptions 0" in lines[-1]
        finally:
            logger.close()
            follower.close()


def test_launch_logs_a_stats_line_at_the_interval_asked_for(tiny_qwen3_dir):
    proc = subprocess.Popen(
        [str(ROOT / "scripts" / "launch.sh"), "--model", tiny_qwen3_dir, "--device", "cpu",
         "--dtype", "float32", "--max-model-len", "256", "--log-stats-interval", "0.5",
         "--no-http"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    read_until = LauncherLines(proc).read_until

    try:
        address = read_until(r"clients connect to: (\S+)").group(1)
        with Client(address) as client:
            out = client.generate("count the stats", params=PARAMS)
        assert len(out.token_ids) == 6
        busy = read_until(r"^nanopipe: ([\d,.]+) gen tok/s, ([\d,.]+) prompt tok/s, running "
                          r"\d+, waiting \d+, KV [\d.]+% used, prefix hits \S+, "
                          r"preemptions \d+, CPU busy [\d.]+%(, spec accepted [\d.]+%)?$",
                          timeout=10)
        while float(busy.group(1).replace(",", "")) == 0:  # an idle line before the request
            busy = read_until(r"^nanopipe: ([\d,.]+) gen tok/s", timeout=10)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
