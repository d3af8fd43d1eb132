"""`nanopipe bench` and `nanopipe profile` as a user runs them: every CPU-capable workload end to
end on a tiny model with --record and the record it appends (the report that reads them:
test_report.py); the registry's contract; one-line usage errors."""

from __future__ import annotations

import argparse
import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from frontend.bench.cli import add_shared
from frontend.bench.record import portable
from frontend.bench.registry import BENCHMARKS, PROFILES

pytestmark = pytest.mark.slow  # the benchmark tool's runs

ROOT = Path(__file__).resolve().parents[2]
RECORD_KEYS = {"workload", "command", "date", "hardware", "commit", "figures"}


def nanopipe(*args: str, ok: bool = True, cwd: Path = ROOT,
             timeout: int = 300) -> subprocess.CompletedProcess:
    """`nanopipe ARGS` from this checkout (the console script's own entry point)."""
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    done = subprocess.run([sys.executable, "-c", "import sys; from frontend.engine.cli import "
                           "main; sys.exit(main())", *args], cwd=cwd, capture_output=True,
                          text=True, timeout=timeout, env=dict(os.environ, PYTHONPATH=path))
    if ok:
        assert done.returncode == 0, done.stderr[-3000:]
    return done


def recorded(path: Path, workload: str, notes: str | None = None,
             measured: bool | None = None) -> dict[str, float]:
    """The one record the run appended: its keys, workload, command and figures, and the
    device ceilings of its hardware bound (measured or nominal) where `measured` is given."""
    lines = path.read_text().splitlines()
    assert len(lines) == 1
    raw = json.loads(lines[0])
    assert set(raw) == (RECORD_KEYS | ({"notes"} if notes else set())
                        | ({"ceilings"} if measured is not None else set()))
    if measured is not None:
        assert raw["ceilings"]["measured"] is measured and raw["ceilings"]["copy_tb_s"] > 0
    assert raw["workload"] == workload and raw.get("notes") == notes
    assert raw["command"].startswith("nanopipe ") and raw["date"].endswith("Z")
    assert raw["hardware"] and raw["commit"] and raw["figures"]
    assert str(ROOT) not in raw["command"]  # paths under the working directory are relative
    return raw["figures"]


def test_every_registered_module_keeps_the_contract():
    for table in (BENCHMARKS, PROFILES):
        for name, entry in table.items():
            module = importlib.import_module(entry.module)
            assert callable(module.add_arguments) and callable(module.run), name
            assert getattr(module, "MODEL", "none") in ("none", "optional", "required"), name
            assert module.__doc__, name
            ap = argparse.ArgumentParser()  # its flags and the shared ones do not clash
            module.add_arguments(ap)
            add_shared(ap, module)
    listing = nanopipe("bench", "--help").stdout
    assert all(f"  {name} " in listing for name in BENCHMARKS)
    assert all(f"  {name} " in nanopipe("profile", "--help").stdout for name in PROFILES)


def test_usage_errors_are_one_line():
    done = nanopipe("bench", "fastest", ok=False)
    assert done.returncode == 2
    assert done.stderr.strip() == ("nanopipe bench: unknown 'fastest'; one of: "
                                   + ", ".join(BENCHMARKS))
    no_peer = nanopipe("bench", "prefix", "--peer", "nano-vllm", "/x", ok=False)
    assert no_peer.returncode == 2 and "unrecognized arguments: --peer" in no_peer.stderr
    needs_model = nanopipe("bench", "latency", ok=False)
    assert needs_model.returncode == 2 and "--model --make-random" in needs_model.stderr
    one_gpu = nanopipe("bench", "kv-transfer", "--device", "cpu", "--across-gpus", ok=False)
    assert one_gpu.returncode == 2
    assert "--across-gpus needs --device cuda and two visible GPUs" in one_gpu.stderr
    bad_dtype = nanopipe("bench", "kv-transfer", "--device", "cpu", "--dtype", "float17", ok=False)
    assert bad_dtype.returncode == 2 and "--dtype float17: not a torch dtype" in bad_dtype.stderr


@pytest.mark.slow
def test_throughput_records_its_figures(tiny_qwen3_dir, tmp_path):
    rec = tmp_path / "results.jsonl"
    out = nanopipe("bench", "throughput", "--model", tiny_qwen3_dir, "--device", "cpu",
                   "--num-seqs", "3", "--max-input-len", "40", "--max-output-len", "8",
                   "--kv-cache-bytes", str(4 << 20), "--modes", "ahead,runtime",
                   "--record", str(rec)).stdout
    figures = recorded(rec, "throughput", measured=False)  # the nominal figures on a CPU
    assert figures["output_tok_s"] > 0 and figures["output_tok_s[runtime]"] > 0
    assert 0 < figures["output_tok_s/bound"] < 1 and 0 <= figures["gpu_idle_pct[ahead]"] < 100
    assert "of the hardware bound" in out.split("figures:")[1]
    assert "hardware bound at: copy 4.3 TB/s, bf16 matmul 790 TFLOP/s, nominal H200" in out


@pytest.mark.slow
def test_serving_records_each_rate(tiny_qwen3_dir, tmp_path):
    rec = tmp_path / "r.jsonl"
    nanopipe("bench", "serving", "--model", tiny_qwen3_dir, "--device", "cpu", "--rates", "20",
             "--num-requests", "3", "--prompt-len-range", "8", "16", "--max-tokens", "4",
             "--record", str(rec))
    figures = recorded(rec, "serving")
    assert figures["output_tok_s@20"] > 0
    assert 0 < figures["ttft_ms_p50@20"] <= figures["ttft_ms_p99@20"]
    assert 0 < figures["itl_ms_p50@20"] <= figures["itl_ms_p99@20"]


def test_prefix_saves_prefill_with_the_cache_on(tiny_qwen3_dir, tmp_path):
    rec = tmp_path / "r.jsonl"
    nanopipe("bench", "prefix", "--model", tiny_qwen3_dir, "--device", "cpu",
             "--num-requests", "4", "--prefix-len", "64", "--suffix-len-range", "4", "8",
             "--max-tokens", "4", "--record", str(rec))
    figures = recorded(rec, "prefix")
    # Three of the four requests find the 64-token prefix (four blocks of 16) cached.
    assert 50 < figures["prefill_saved_pct"] < 100
    assert figures["output_tok_s"] > 0 and figures["output_tok_s[cache off]"] > 0


@pytest.mark.slow
def test_latency_records_tpot_against_its_floor(tiny_qwen3_dir, tmp_path):
    rec = tmp_path / "r.jsonl"
    nanopipe("bench", "latency", "--model", tiny_qwen3_dir, "--device", "cpu",
             "--prompt-len", "32", "--max-tokens", "8", "--reps", "2", "--hop-iters", "200",
             "--record", str(rec))
    figures = recorded(rec, "latency", measured=False)
    assert figures["tpot_ms"] > 0 and figures["ttft_ms"] > 0 and figures["tpot_ms[direct]"] > 0
    assert 0 < figures["tpot_ms/bound"] < 1  # a tiny model on a CPU is far from the H200 floor
    assert figures["zmq_hop_us[result]"] > 0 and figures["zmq_hop_us[plan]"] > 0


@pytest.mark.slow
def test_fairness_records_the_victims_ttft_alone_and_under_the_hog(tiny_qwen3_dir, tmp_path):
    rec = tmp_path / "r.jsonl"
    out = nanopipe("bench", "fairness", "--model", tiny_qwen3_dir, "--device", "cpu",
                   "--hog-streams", "6", "--hog-tokens", "40", "--max-num-seqs", "2",
                   "--victim-requests", "2", "--victim-prompt-len", "20", "--record", str(rec))
    figures = recorded(rec, "fairness")
    assert figures["victim_ttft_ms[alone]"] > 0 and figures["victim_ttft_ms[hog]"] > 0
    # The hog, aborted after the victim's answers, had not finished its backlog by then.
    [result] = [json.loads(line) for line in out.stdout.splitlines()
                if line.startswith('{"ttft_ms_alone"')]
    assert result["hog_streams_finished_first"] < 6


@pytest.mark.slow
def test_cpu_records_the_ratio_to_transformers(tiny_qwen3_dir, tmp_path):
    rec = tmp_path / "r.jsonl"
    out = nanopipe("bench", "cpu", "--model", tiny_qwen3_dir, "--new-tokens", "4",
                   "--batch-sizes", "1,2", "--batch1-prompts", "1", "--repeats", "1",
                   "--record", str(rec)).stdout
    figures = recorded(rec, "cpu")
    assert figures["output_tok_s@1"] > 0 and figures["output_tok_s@1/peer"] > 0
    assert figures["output_tok_s@2/peer"] > 0 and "x transformers" in out


@pytest.mark.slow
def test_speculative_keeps_the_tokens_and_records_the_speedup(tiny_qwen3_dir, tmp_path):
    rec = tmp_path / "r.jsonl"
    nanopipe("bench", "speculative", "--model", tiny_qwen3_dir, "--device", "cpu",
             "--batch-sizes", "1", "--batch1-prompts", "1", "--new-tokens", "8",
             "--record", str(rec))
    figures = recorded(rec, "speculative")
    assert figures["speedup@1"] > 0 and figures["output_tok_s@1[off]"] > 0


@pytest.mark.slow
def test_dp_records_the_prefill_affinity_saves(tiny_qwen3_dir, tmp_path):
    rec = tmp_path / "r.jsonl"
    nanopipe("bench", "dp", "--model", tiny_qwen3_dir, "--device", "cpu", "--groups", "2",
             "--per-group", "3", "--prefix-len", "64", "--max-tokens", "4",
             "--record", str(rec))
    figures = recorded(rec, "dp")
    assert figures["prefill_saved_pct"] > 0
    assert figures["router_decisions_per_s[affinity]"] > 0


@pytest.mark.slow
def test_disagg_records_short_itl_and_the_transfer(tiny_qwen3_dir, tmp_path):
    rec = tmp_path / "r.jsonl"
    nanopipe("bench", "disagg", "--model", tiny_qwen3_dir, "--device", "cpu", "--modes",
             "colocated,disagg-frames,disagg-shared", "--num-requests", "6", "--rate", "8",
             "--long-share", "0.5", "--long-len-range", "100", "120", "--record", str(rec))
    figures = recorded(rec, "disagg")
    assert figures["short_itl_ms_p99[colocated]"] > 0
    for mode in ("disagg-frames", "disagg-shared"):
        assert figures[f"output_tok_s[{mode}]"] > 0
        assert figures[f"transfer_ms_p50[{mode}]"] > 0 and figures[f"transfer_gib_s[{mode}]"] > 0
    assert "transfer_ms_p50[colocated]" not in figures


@pytest.mark.slow
def test_tp_parity_and_w1_per_size_over_gloo(tiny_qwen3_dir, tmp_path):
    rec = tmp_path / "r.jsonl"
    nanopipe("bench", "tp", "--model", tiny_qwen3_dir, "--device", "cpu", "--tp", "1,2",
             "--num-prompts", "2", "--max-tokens", "4", "--w1-num-seqs", "2",
             "--w1-max-input-len", "100", "--w1-max-output-len", "100", "--min-match", "0",
             "--record", str(rec), timeout=600)
    figures = recorded(rec, "tp", measured=False)
    assert 0 <= figures["parity_match@tp2"] <= 1
    assert figures["output_tok_s@tp1"] > 0 and figures["output_tok_s@tp2"] > 0


def test_steploop_records_the_time_per_step(tmp_path):
    """--record without a file appends to the project's records, docs/benchmarks/; --notes
    goes with it."""
    nanopipe("bench", "steploop", "--steps", "30", "--repeats", "1", "--notes", "a quiet host",
             "--record", cwd=tmp_path)
    rec = tmp_path / "docs" / "benchmarks" / "results.jsonl"
    assert recorded(rec, "steploop", notes="a quiet host")["us_per_step@1"] > 0


def test_a_recorded_command_keeps_no_machine_path(tmp_path):
    home, cwd = tmp_path / "home" / "me", tmp_path / "srv" / "repo"
    args = ["--model", str(cwd / "models" / "tiny"), "--peer", "nano-vllm",
            str(home / "nano-vllm"), "--out", str(tmp_path / "srv" / "scratch"), "--x", "/opt/m"]
    # Under the working directory: relative; under home: ~; sharing the working directory's
    # first folder: relative to it; elsewhere (a first folder of its own): as given.
    assert portable(args, cwd, home) == ["--model", "models/tiny", "--peer", "nano-vllm",
                                         "~/nano-vllm", "--out", "../scratch", "--x", "/opt/m"]


@pytest.mark.gpu
def test_kernels_record_the_sampler_against_torch(tmp_path):
    rec = tmp_path / "r.jsonl"
    nanopipe("bench", "kernels", "--only", "sampler", "--iters", "5", "--record", str(rec))
    figures = recorded(rec, "kernels", measured=True)
    assert figures["sampler_us"] > 0 and figures["sampler_us/peer"] > 0


@pytest.mark.gpu
def test_throughput_on_the_gpu_records_its_ratio_to_the_bound(tmp_path):
    """The in-process mode first: the pipeline after it sizes its KV pool from free memory,
    which the runtime's pool and graphs must have left."""
    rec = tmp_path / "r.jsonl"
    nanopipe("bench", "throughput", "--make-random", "smollm2-135m", "--num-seqs", "16",
             "--max-input-len", "256", "--max-output-len", "128", "--modes", "runtime,ahead",
             "--record", str(rec), timeout=600)
    figures = recorded(rec, "throughput", measured=True)
    assert 0 < figures["output_tok_s/bound"] < 1 and figures["output_tok_s[ahead]"] > 0


def test_profile_step_records_its_window(tiny_qwen3_dir, tmp_path):
    rec = tmp_path / "r.jsonl"
    nanopipe("profile", "step", "--model", tiny_qwen3_dir, "--device", "cpu", "--num-seqs", "2",
             "--max-input-len", "100", "--max-output-len", "100", "--window", "3,5",
             "--kv-cache-bytes", str(4 << 20), "--record", str(rec))
    figures = recorded(rec, "profile step")
    assert figures["wall_ms_per_step"] > 0 and 0 < figures["device_busy_pct"] <= 100


@pytest.mark.slow
def test_kv_transfer_times_both_modes_between_two_processes(tmp_path):
    rec = tmp_path / "r.jsonl"
    nanopipe("bench", "kv-transfer", "--device", "cpu", "--tokens", "64", "--requests", "2",
             "--record", str(rec))
    figures = recorded(rec, "kv-transfer")
    for mode in ("frames", "shared"):
        assert figures[f"gib_s[{mode}]"] > 0 and figures[f"ms_per_request[{mode}]"] > 0
    assert figures["shared_speedup"] > 0


@pytest.mark.slow
def test_profile_tp_records_each_size_step(tiny_qwen3_dir, tmp_path):
    rec = tmp_path / "r.jsonl"
    out = nanopipe("profile", "tp", "--model", tiny_qwen3_dir, "--device", "cpu", "--tp", "1,2",
                   "--num-seqs", "3", "--max-input-len", "100", "--max-output-len", "100",
                   "--window", "10,14", "--kv-cache-bytes", str(8 << 20), "--record", str(rec),
                   timeout=600).stdout
    figures = recorded(rec, "profile tp")
    assert figures["wall_ms_per_step@tp1"] > 0 and figures["wall_ms_per_step@tp2"] > 0
    assert "per step, rank 0: TP=2 against TP=1" in out


STAND_IN = '''"""nano-vLLM's API (LLM, SamplingParams, generate) over nanopipe's LLM on the
CPU: what the peer plumbing sends and reads, without nano-vLLM's CUDA-only engine."""
import atexit
from dataclasses import dataclass

from frontend import LLM as _LLM
from protocol import SamplingParams as _Params


@dataclass
class SamplingParams:
    temperature: float = 1.0
    max_tokens: int = 64
    ignore_eos: bool = False


class LLM:
    def __init__(self, model, enforce_eager=False, tensor_parallel_size=1, max_model_len=4096,
                 max_num_seqs=256, max_num_batched_tokens=16384):
        self.llm = _LLM(model, device="cpu", max_model_len=max_model_len,
                        max_num_seqs=max_num_seqs, kv_cache_bytes=8 << 20,
                        max_num_batched_tokens=max(max_num_batched_tokens, max_model_len))
        atexit.register(self.llm.close)

    def generate(self, prompts, sampling_params, use_tqdm=True):
        params = sampling_params if isinstance(sampling_params, list) \\
            else [sampling_params] * len(prompts)
        return self.llm.generate(prompts, [_Params(temperature=p.temperature, max_tokens=
                                 p.max_tokens, ignore_eos=p.ignore_eos) for p in params],
                                 use_tqdm=False)
'''


@pytest.fixture
def peer_checkout(tmp_path) -> str:
    """A checkout whose `nanovllm` package is a stand-in with nano-vLLM's API (STAND_IN)."""
    package = tmp_path / "peer" / "nanovllm"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("from nanovllm.llm import LLM, SamplingParams\n")
    (package / "llm.py").write_text(STAND_IN)
    return str(package.parent)


@pytest.mark.slow
def test_throughput_and_latency_record_their_ratio_to_a_peer(tiny_qwen3_dir, tmp_path,
                                                             peer_checkout):
    rec = tmp_path / "r.jsonl"
    out = nanopipe("bench", "throughput", "--model", tiny_qwen3_dir, "--device", "cpu",
                   "--num-seqs", "3", "--max-input-len", "40", "--max-output-len", "8",
                   "--kv-cache-bytes", str(4 << 20), "--peer", "nano-vllm", peer_checkout,
                   "--record", str(rec)).stdout
    figures = recorded(rec, "throughput", measured=False)
    assert figures["output_tok_s[nano-vllm]"] > 0 and figures["output_tok_s/peer"] > 0
    assert "x nano-vllm (" in out
    rec.unlink()
    nanopipe("bench", "latency", "--model", tiny_qwen3_dir, "--device", "cpu", "--prompt-len",
             "32", "--max-tokens", "24", "--reps", "3", "--hop-iters", "200", "--peer",
             "nano-vllm", peer_checkout, "--record", str(rec))
    figures = recorded(rec, "latency", measured=False)
    assert figures["tpot_ms/peer"] > 0 and figures["ttft_ms/peer"] > 0
