"""The speed tooling as a user runs it on a tiny CPU model: `nanopipe bench throughput`'s GPU
idle share and figure, `bench serving`'s figure, --make-random smollm2-135m, --peer's refusal
of a directory that is no checkout, the step loop's modelled worker, and `nanopipe profile`
step, host, startup and cpu (with and without the matmuls)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # the benchmark tool's runs

ROOT = Path(__file__).resolve().parents[2]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


NANOPIPE = (sys.executable, "-c", "import sys; from frontend.engine.cli import main; "
            "sys.exit(main())")
"""The `nanopipe` console script, run from this checkout."""


def run_script(*args: str, ok: bool = True,
               env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """`nanopipe ARGS` (the benchmark tool's subcommands), from the repository root."""
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env = dict(os.environ, PYTHONPATH=path, **(env or {}))
    done = subprocess.run([*NANOPIPE, *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    if ok:
        assert done.returncode == 0, done.stderr[-3000:]
    return done


def json_lines(out: str) -> list[dict]:
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


@pytest.mark.slow
def test_throughput_reports_gpu_idle_and_plots(tiny_qwen3_dir, tmp_path):
    png = tmp_path / "w1.png"
    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps(dict(
        steps=[400, 450], launches_per_step=300.0, gpu_busy_fraction=0.8,
        gpu_ms_per_step={"attention": 4.4, "GEMM": 1.0, "other": 0.2})))
    out = run_script("bench", "throughput", "--model", tiny_qwen3_dir, "--device", "cpu",
                     "--num-seqs", "3", "--max-input-len", "100", "--max-output-len", "100",
                     "--modes", "on", "--plot", str(png), "--profile-json", str(profile)).stdout
    (result,) = json_lines(out)
    assert result["output_tokens"] == 300
    # The workers' busy time lies inside the W1 wall time.
    assert 0 < result["gpu_busy_s"] <= result["seconds"]
    assert 0 <= result["gpu_idle_pct"] < 100
    assert f"GPU idle {result['gpu_idle_pct']:.1f}%" in out
    assert png.read_bytes().startswith(PNG_MAGIC)


@pytest.mark.slow
def test_serving_plots_each_rate(tiny_qwen3_dir, tmp_path):
    png = tmp_path / "w2.png"
    out = run_script("bench", "serving", "--model", tiny_qwen3_dir, "--device", "cpu",
                     "--rates", "20,40", "--num-requests", "3", "--prompt-len-range", "8", "16",
                     "--max-tokens", "4", "--plot", str(png)).stdout
    results = json_lines(out)
    assert [r["rate_req_s"] for r in results] == [20, 40]
    assert all(r["completed"] == 3 for r in results)
    for r in results:  # the TTFT's split, from the requests' own metrics, fits inside it
        assert 0 <= r["queued_ms_p50"] and 0 < r["scheduled_to_first_ms_p50"]
        assert r["queued_ms_p50"] + r["scheduled_to_first_ms_p50"] <= r["ttft_ms_p99"]
    assert png.read_bytes().startswith(PNG_MAGIC)


def test_peer_refuses_a_directory_without_its_package(tiny_qwen3_dir, tmp_path):
    done = run_script("bench", "throughput", "--model", tiny_qwen3_dir, "--device", "cpu",
                      "--peer", "nano-vllm", str(tmp_path), ok=False)
    assert done.returncode == 2
    assert f"--peer nano-vllm {tmp_path}: no nanovllm/llm.py there" in done.stderr
    other = run_script("bench", "throughput", "--model", tiny_qwen3_dir, "--peer", "vllm",
                       str(tmp_path), ok=False)
    assert other.returncode == 2 and "--peer vllm: this workload runs nano-vllm" in other.stderr


def test_make_random_smollm2_has_the_embedded_model_shape(tmp_path, monkeypatch):
    from frontend.bench.common import make_random, param_count
    from gpu_workers import ModelConfig

    make_random("smollm2-135m", tmp_path, "cpu", tokenizer=True)
    mc = ModelConfig.from_dir(str(tmp_path))
    assert (mc.model_type, mc.num_layers, mc.num_heads, mc.num_kv_heads, mc.head_dim,
            mc.vocab_size, mc.qk_norm) == ("llama", 30, 9, 3, 64, 49152, False)
    assert param_count(str(tmp_path)) == 134_515_008  # SmolLM2-135M's own count


def test_profile_step_breaks_a_window_of_steps_down(tiny_qwen3_dir, tmp_path):
    out_json = tmp_path / "profile.json"
    out = run_script("profile", "step", "--model", tiny_qwen3_dir, "--device", "cpu",
                     "--num-seqs", "2", "--max-input-len", "100", "--max-output-len", "100",
                     "--window", "3,5", "--kv-cache-bytes", str(4 << 20),
                     "--json", str(out_json)).stdout
    result = json.loads(out_json.read_text())
    assert result["steps"] == [3, 5] and result["running_at_first"] == 2
    cats = result["gpu_ms_per_step"]
    assert set(cats) == {"attention", "GEMM", "norm", "rotary/kv-store", "elementwise/copies",
                         "sampler", "collectives", "other"}
    # A decode step of a transformer runs matmuls, attention and the sampler.
    assert cats["GEMM"] > 0 and cats["attention"] > 0 and cats["sampler"] > 0
    assert sum(cats.values()) <= result["wall_ms_per_step"]
    assert 0 < result["gpu_busy_fraction"] <= 1 and result["launches_per_step"] > 0
    assert "launches/step" in out and "sampler" in out


def test_profile_step_refuses_a_bad_window(tiny_qwen3_dir):
    done = run_script("profile", "step", "--model", tiny_qwen3_dir, "--device", "cpu",
                      "--window", "9,3", ok=False)
    assert done.returncode != 0 and "--window needs 0 <= FIRST < LAST" in done.stderr


def test_profile_host_times_every_stage_of_a_step(tiny_qwen3_dir, tmp_path):
    out_json = tmp_path / "host.json"
    out = run_script("profile", "host", "--model", tiny_qwen3_dir, "--device", "cpu",
                     "--num-seqs", "3", "--max-input-len", "100", "--max-output-len", "100",
                     "--at", "2", "--steps", "5", "--kv-cache-bytes", str(4 << 20),
                     "--cprofile", "5", "--functions", "--json", str(out_json),
                     "--record", str(tmp_path / "r.jsonl")).stdout
    result = json.loads(out_json.read_text())
    assert result["running"] == 3 and result["steps"] == 5
    (record,) = [json.loads(line) for line in (tmp_path / "r.jsonl").read_text().splitlines()]
    assert record["workload"] == "profile host"
    assert record["figures"]["wall_ms_per_step"] == result["wall_ms"]
    assert record["figures"]["host_ms[launch]"] == result["host_ms"]["launch"]
    host = result["host_ms"]
    assert list(host) == ["schedule", "encode_plan", "decode_plan", "launch", "finish",
                          "encode_result", "decode_result", "process"]
    assert all(v > 0 for v in host.values())
    # On the CPU the forward runs inside launch, and the runner's timer sees it.
    assert 0 < result["device_ms"] <= host["launch"] + host["finish"]
    assert sum(host.values()) <= result["wall_ms"] * 1.05
    assert "Ordered by: internal time" in out and "model_runner.py" in out
    # --functions: each function's time per step, the launch holding the ones it calls.
    per_step = {line.split()[-1]: float(line.split()[0]) for line in
                out.split("inside each function")[1].splitlines()[1:] if "calls" in line}
    assert per_step["ModelRunner.launch"] >= per_step["build_batch"] > 0
    assert per_step["build_batch"] >= per_step["lay_out"] > 0
    assert per_step["SequenceTable.apply"] > 0 and per_step["ModelRunner.finish"] > 0


def test_profile_startup_profiles_a_second_start_in_a_fresh_process(tiny_qwen3_dir, tmp_path):
    out = run_script("profile", "startup", "--model", tiny_qwen3_dir, "--device", "cpu",
                     "--serve-args", "--kv-offloading-size 0 --max-model-len 256", "--cold",
                     "--top", "6", "--record", str(tmp_path / "r.jsonl")).stdout
    lines = out.splitlines()
    filling = next(line for line in lines if line.startswith("filling start (cold caches): "))
    profiled = next(line for line in lines if line.startswith("profiled start: "))
    assert "weights" in filling and "kv" in profiled
    # The profiled start is a ModelRunner's, function by function, in both orders.
    assert "model_runner.py" in out and "__init__" in out
    assert "Ordered by: cumulative time" in out and "Ordered by: internal time" in out
    (record,) = [json.loads(line) for line in (tmp_path / "r.jsonl").read_text().splitlines()]
    total = float(profiled.split(": ")[1].split(" s")[0])
    assert record["figures"]["start_s[profiled]"] == pytest.approx(total, abs=0.01)
    # A flag the engine refuses ends the run with the engine's own words.
    done = run_script("profile", "startup", "--model", tiny_qwen3_dir, "--device", "cpu",
                      "--serve-args", "--max-model-len -3", ok=False)
    assert done.returncode != 0 and "max-model-len" in done.stderr
    done = run_script("profile", "startup", "--model", tiny_qwen3_dir, "--device", "cpu",
                      "--top", "0", ok=False)
    assert done.returncode != 0 and "--top must be at least 1" in done.stderr


def test_profile_host_says_when_w1_ends_before_the_last_step(tiny_qwen3_dir):
    done = run_script("profile", "host", "--model", tiny_qwen3_dir, "--device", "cpu",
                      "--num-seqs", "1", "--max-input-len", "100", "--max-output-len", "100",
                      "--at", "150", "--kv-cache-bytes", str(4 << 20), ok=False)
    assert done.returncode != 0 and "W1 finished before the last measured step" in done.stderr


@pytest.mark.slow
def test_throughput_runs_a_smoke_w1_two_plans_ahead(tiny_qwen3_dir):
    """Maximum lengths under W1's 100 (the docstring's CPU smoke run) and the ahead2 mode,
    with a host KV tier (off by default on the CPU)."""
    out = run_script("bench", "throughput", "--model", tiny_qwen3_dir, "--device", "cpu",
                     "--num-seqs", "4", "--max-input-len", "40", "--max-output-len", "12",
                     "--modes", "ahead2", "--kv-offloading-size", "0.01").stdout
    (result,) = json_lines(out)
    assert result["mode"] == "ahead2" and 4 <= result["output_tokens"] <= 48
    bad = run_script("bench", "throughput", "--model", tiny_qwen3_dir, "--modes", "fast",
                      ok=False)
    assert bad.returncode == 2 and "--modes takes off, on, ahead" in bad.stderr
    refused = run_script("bench", "throughput", "--model", tiny_qwen3_dir, "--device", "cpu",
                         "--kv-offloading-size", "-1", ok=False)
    assert refused.returncode == 2 and "Traceback" not in refused.stderr
    assert "kv_offloading_size must be >= 0" in refused.stderr


@pytest.mark.slow
def test_throughput_gives_each_mode_its_own_host_timeline(tiny_qwen3_dir, tmp_path):
    timeline = tmp_path / "timeline"
    env = {"NANOPIPE_HOST_TIMELINE": str(timeline)}
    out = run_script("bench", "throughput", "--model", tiny_qwen3_dir, "--device", "cpu",
                     "--num-seqs", "4", "--max-input-len", "40", "--max-output-len", "12",
                     "--modes", "ahead,ahead2", env=env).stdout
    assert [r["mode"] for r in json_lines(out)] == ["ahead", "ahead2"]
    for sub in ("1-ahead", "2-ahead2"):
        assert sorted(p.name for p in (timeline / sub).iterdir()) == ["scheduler0.json",
                                                                       "worker0.json"]
        done = run_script("profile", "timeline", str(timeline / sub), "--skip", "0")
        assert "plan hop" in done.stdout and "period" in done.stdout


def test_the_pacing_meter_plans_two_ahead_only_where_the_modelled_host_paces():
    """The real scheduler process with plans-ahead auto against the modelled worker: a 300 µs
    launch before a 100 µs device step (the host's chain paces) gets steps planned two ahead;
    a 20 ms device step (the device paces) gets none, as does one plan ahead."""
    def two_ahead(ahead: str, device_us: str, launch_us: str) -> int:
        out = run_script("bench", "steploop", "--steps", "40", "--repeats", "1",
                         "--device-us", device_us, "--launch-us", launch_us,
                         "--plans-ahead", ahead).stdout
        line = next(x for x in out.splitlines() if "steps planned two ahead" in x)
        return int(line.rsplit("; ", 1)[1].split(" steps planned two ahead")[0])

    assert two_ahead("auto", "100", "300") > 0
    assert two_ahead("auto", "20000", "100") == 0
    assert two_ahead("1", "100", "300") == 0


def test_steploop_models_a_device_it_cannot_outrun():
    """With a simulated device the steps take at least the device time each (the first may
    have started before the timed window), whatever the plans ahead; the modelled worker
    serves every plan (the run ends)."""
    for ahead in ("1", "2"):
        out = run_script("bench", "steploop", "--steps", "60", "--repeats", "1",
                         "--device-us", "2000", "--launch-us", "300", "--plans-ahead",
                         ahead).stdout
        line = next(x for x in out.splitlines() if "steps planned two ahead" in x)
        assert f"{ahead} plan(s) ahead, worker lookahead" in line
        per_step_us = float(line.split(": ")[1].split(" µs")[0])
        assert per_step_us >= 2000 * 59 / 60


@pytest.mark.slow
def test_profile_cpu_compares_steps_with_and_without_their_matmuls(tiny_qwen3_dir):
    """Both engines decode the same greedy tokens; with --no-matmul every linear layer of each
    decode step (and only those) is skipped on both sides."""
    base = ("profile", "cpu", "--model", tiny_qwen3_dir, "--steps", "4",
            "--batch-sizes", "1,3")
    out = run_script(*base).stdout
    assert "batch  1: same greedy tokens over 5: 1/1 sequences" in out
    assert "batch  3: same greedy tokens over 5: 3/3 sequences" in out
    out = run_script(*base, "--no-matmul").stdout
    layers = json.loads((Path(tiny_qwen3_dir) / "config.json").read_text())["num_hidden_layers"]
    # nanopipe packs qkv and gate/up: four matmuls a layer against transformers' seven; the
    # LM head is one more on each side.
    steps = 4
    skipped = (f"matmuls skipped: nanopipe {steps * (4 * layers + 1)}, "
               f"transformers {steps * (7 * layers + 1)}")
    assert f"batch  1: {skipped}" in out and f"batch  3: {skipped}" in out
    assert out.count("per decode step") == 2 and "same greedy tokens" not in out
