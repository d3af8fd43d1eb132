"""An actor's start-up spec: plain msgpack on stdin, rebuilt into its typed configs."""

from __future__ import annotations

import subprocess
import sys

import msgpack
import pytest

from gpu_workers.config import WorkerConfig
from protocol import Endpoints
from protocol.actor_start import ActorStart, decode_start, encode_start, from_plain, to_plain
from scheduler_proc.config import SchedulerConfig


def test_configs_and_endpoints_survive_the_trip(tmp_path):
    endpoints = Endpoints.tcp(2)
    worker = WorkerConfig(model=str(tmp_path), dtype="float32", kv_cache_bytes=1 << 20,
                          dist_init_method=endpoints.dist_init_method)
    sched = SchedulerConfig(num_kv_blocks=64, block_size=16, max_model_len=256)
    start = ActorStart(role="worker", rank=1, launcher_pid=42, config={
        "worker": to_plain(worker), "scheduler": to_plain(sched),
        "endpoints": to_plain(endpoints)})
    back = decode_start(encode_start(start))
    assert (back.role, back.rank, back.launcher_pid) == ("worker", 1, 42)
    assert from_plain(WorkerConfig, back.config["worker"]) == worker
    assert from_plain(SchedulerConfig, back.config["scheduler"]) == sched
    rebuilt = from_plain(Endpoints, back.config["endpoints"])
    assert rebuilt == endpoints and isinstance(rebuilt.worker_steps, tuple)
    assert rebuilt.keys == endpoints.keys  # the run's CURVE keys, bytes intact
    endpoints.cleanup()


def test_a_spec_is_plain_msgpack_not_pickle():
    frame = encode_start(ActorStart("tokenizer", 0, 1, {"tokenizer": {"model": "m"}}))
    assert msgpack.unpackb(frame, raw=False)["role"] == "tokenizer"
    with pytest.raises(ValueError):
        decode_start(b"\x80\x04\x95" + b"\x00" * 16)  # a pickle header is not a spec


@pytest.mark.parametrize("module", ["gpu_workers.worker_proc", "scheduler_proc.scheduler_loop",
                                    "frontend.actors.tokenizer", "frontend.actors.detokenizer"])
def test_an_actor_run_by_hand_says_how_to_start_a_pipeline(module):
    done = subprocess.run([sys.executable, "-m", module], stdin=subprocess.DEVNULL,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert "start a pipeline with `nanopipe serve`" in done.stderr

