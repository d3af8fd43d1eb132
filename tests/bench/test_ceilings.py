"""The device ceilings behind every hardware bound: the bound scales with them, a CPU run falls
back to the nominal H200 figures and says so, a CUDA run measures once (in a child process),
and a record carries the ceilings its bound used."""

from __future__ import annotations

import json
import subprocess
from types import SimpleNamespace

import pytest
import torch

from frontend.bench import ceilings as ceilings_module
from frontend.bench.ceilings import (
    NOMINAL,
    DeviceCeilings,
    device_ceilings,
    measure_in_child,
    parse_probe_output,
    used_ceilings,
)
from frontend.bench.common.hardware import Throughput, hardware_bound_s
from frontend.bench.figures import Figure, print_figures
from frontend.bench.record import append, make_record, read
from frontend.bench.workloads.kernels_gemm import floor_us
from gpu_workers import ModelConfig

H100 = DeviceCeilings(3.0e12, 780e12, "NVIDIA H100 80GB HBM3", measured=True)

# A model of 1,000 bf16 parameters, 1,000 KV bytes per token, attention 2 layers x 4 heads x 8.
MC = SimpleNamespace(kv_bytes_per_token=lambda: 1000, dtype=torch.bfloat16, num_layers=2,
                     num_heads=4, head_dim=8)
WORK = [([0] * 10, 5), ([0] * 20, 3)]  # (prompt, output tokens)
READ_BYTES = 1000 * (5 * 10 + 10) + 1000 * (3 * 20 + 3) + 1000 * 2 * 5  # KV, then weights
FLOPS = 2 * 1000 * 30 + 256 * (10**2 + 20**2) // 2  # projections, then causal attention


@pytest.fixture(autouse=True)
def fresh_run():
    """Each test is a run of its own: nothing measured or used yet."""
    ceilings_module.forget()
    yield
    ceilings_module.forget()


def test_the_bound_reads_at_the_copy_rate_and_computes_at_the_matmul_rate():
    t, parts = hardware_bound_s(MC, 1000, WORK, H100)
    assert t == pytest.approx(READ_BYTES / 3.0e12 + FLOPS / 780e12, rel=1e-12)
    assert parts["kv_read_tb"] + parts["weights_tb"] == pytest.approx(READ_BYTES / 1e12)
    assert parts["prefill_tflop"] == pytest.approx(FLOPS / 1e12)
    # The nominal figures give the bound the fixed H200 constants gave.
    nominal, _ = hardware_bound_s(MC, 1000, WORK, NOMINAL)
    assert nominal == pytest.approx(READ_BYTES / 4.3e12 + FLOPS / 790e12, rel=1e-12)


def test_the_bound_scales_with_each_ceiling():
    base, _ = hardware_bound_s(MC, 1000, WORK, H100)
    twice = DeviceCeilings(6.0e12, 1560e12, "faster", measured=True)
    assert hardware_bound_s(MC, 1000, WORK, twice)[0] == pytest.approx(base / 2, rel=1e-12)
    copy_only = DeviceCeilings(6.0e12, 780e12, "wider", measured=True)
    assert hardware_bound_s(MC, 1000, WORK, copy_only)[0] == pytest.approx(
        base - READ_BYTES / 6.0e12, rel=1e-12)
    # Decode alone (empty prompts) has no prefill FLOPs: the matmul rate drops out.
    decode = [([], 8)]
    slow_matmul = DeviceCeilings(3.0e12, 1e12, "slow", measured=True)
    assert (hardware_bound_s(MC, 1000, decode, H100)[0]
            == hardware_bound_s(MC, 1000, decode, slow_matmul)[0])
    # The same run against the H100's lower copy rate is nearer its bound than against an
    # H200's: its ratio rises in proportion to the read-bound part.
    tokens, seconds = 1000, 1.0
    on_h100 = Throughput(tokens, seconds, hardware_bound_s(MC, 1000, decode, H100)[0])
    on_h200 = Throughput(tokens, seconds, hardware_bound_s(MC, 1000, decode, NOMINAL)[0])
    assert on_h100.ratio / on_h200.ratio == pytest.approx(4.3 / 3.0)


def test_the_gemm_floor_is_the_read_or_the_flops_whichever_is_longer():
    read_us = 1024 * 1024 * 2 / 3.0e12 * 1e6
    assert floor_us(1, 1024, 1024, H100) == pytest.approx(read_us)  # a skinny product reads
    flops_us = 2 * 4096 * 1024 * 1024 / 780e12 * 1e6
    assert floor_us(4096, 1024, 1024, H100) == pytest.approx(flops_us)  # a wide one computes
    assert floor_us(1, 1024, 1024, NOMINAL) == pytest.approx(read_us * 3.0 / 4.3)


def test_a_cpu_run_uses_the_nominal_figures_and_says_so(monkeypatch):
    monkeypatch.setattr(ceilings_module, "measure_in_child",
                        lambda: pytest.fail("a CPU run measures nothing"))
    assert used_ceilings() is None
    got = device_ceilings("cpu")
    assert got == NOMINAL and not got.measured
    assert (got.copy_bytes_per_s, got.matmul_flops_per_s) == (4.3e12, 790e12)
    assert used_ceilings() == NOMINAL
    assert got.describe() == ("copy 4.3 TB/s, bf16 matmul 790 TFLOP/s, nominal H200 figures "
                              "(not measured)")
    assert got.record() == {"copy_tb_s": 4.3, "matmul_tflop_s": 790.0, "measured": False,
                            "device": "H200"}


def test_a_cuda_run_measures_once(monkeypatch):
    calls = []
    monkeypatch.setattr(ceilings_module, "measure_in_child", lambda: calls.append(1) or H100)
    assert device_ceilings("cuda") == H100 and device_ceilings("cuda") == H100
    assert len(calls) == 1 and used_ceilings() == H100
    assert H100.describe() == ("copy 3 TB/s, bf16 matmul 780 TFLOP/s, measured on "
                               "NVIDIA H100 80GB HBM3")


def test_the_probe_runs_as_a_child_and_without_cuda_falls_back(capsys):
    """The real child process on this machine: without a CUDA device it reports the nominal
    figures, and the parent says the bound is not measured."""
    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device: see the gpu test")
    assert measure_in_child() == NOMINAL
    assert "not measured, the probe found no CUDA device" in capsys.readouterr().err


def test_a_failed_probe_falls_back_to_nominal_with_its_reason(monkeypatch, capsys):
    def failed(*args, **kwargs):
        return subprocess.CompletedProcess(args, 1, "", "Traceback ...\nOutOfMemoryError: x")

    monkeypatch.setattr(ceilings_module.subprocess, "run", failed)
    assert measure_in_child() == NOMINAL
    assert "the probe exited with 1: OutOfMemoryError: x" in capsys.readouterr().err

    def hung(*args, **kwargs):
        raise subprocess.TimeoutExpired(args, 300)

    monkeypatch.setattr(ceilings_module.subprocess, "run", hung)
    assert measure_in_child() == NOMINAL
    assert "the probe did not finish" in capsys.readouterr().err


def test_the_probe_output_is_its_last_json_line():
    line = json.dumps(H100.record())
    assert parse_probe_output(f"a warning\n{line}\n") == H100
    assert parse_probe_output("") is None and parse_probe_output("no json") is None
    assert parse_probe_output(json.dumps({"copy_tb_s": 0, "matmul_tflop_s": 1})) is None


def test_a_record_carries_the_ceilings_its_bound_used(tmp_path):
    results = tmp_path / "r.jsonl"
    figures = {"output_tok_s": 30000.0, "output_tok_s/bound": 0.8}
    append(results, make_record("throughput", "nanopipe bench throughput", "cpu", figures,
                                ceilings=H100))
    append(results, make_record("steploop", "nanopipe bench steploop", "cpu", {"us": 1.0}))
    with_bound, without = (json.loads(line) for line in results.read_text().splitlines())
    assert with_bound["ceilings"] == {"copy_tb_s": 3.0, "matmul_tflop_s": 780.0,
                                      "measured": True, "device": "NVIDIA H100 80GB HBM3"}
    assert "ceilings" not in without  # no bound, no ceilings
    records, skipped = read(results)
    assert skipped == 0 and [r.ceilings for r in records] == [H100, None]


def test_the_printed_figures_name_the_ceilings_of_their_bound(capsys):
    tok = Figure("output_tok_s", 25_000.0, "tok/s", bound=35_800.0)
    print_figures([tok], None, H100)
    assert ("hardware bound at: copy 3 TB/s, bf16 matmul 780 TFLOP/s, measured on NVIDIA H100"
            in capsys.readouterr().out)
    goal = Figure("ready_s", 8.0, "s", bound=10.0, higher_is_better=False, bound_name="the goal")
    print_figures([goal], None, H100)  # a goal is no hardware bound: no ceilings named
    assert "hardware bound at" not in capsys.readouterr().out


def test_a_figure_prints_its_ratios():
    tok = Figure("output_tok_s", 25_000.0, "tok/s", bound=35_800.0, peer=16_668.0)
    assert tok.line("nano-vllm") == ("output_tok_s: 25,000 tok/s  [0.6983 of the hardware bound "
                                     "(35,800 tok/s); 1.500x nano-vllm (16,668 tok/s)]")
    assert tok.record() == {"output_tok_s": 25_000.0, "output_tok_s/bound": 0.6983,
                            "output_tok_s/peer": 1.5}
    tpot = Figure("tpot_ms", 2.0, "ms", bound=0.5, higher_is_better=False)
    assert tpot.ratio_to_bound == 0.25 and tpot.ratio_to_peer is None


@pytest.mark.gpu
def test_the_probe_measures_a_cuda_device():
    got = measure_in_child()
    assert got.measured and got.device_name == torch.cuda.get_device_name(0)
    assert 0.5e12 < got.copy_bytes_per_s < 20e12  # HBM, reads and writes counted
    assert 50e12 < got.matmul_flops_per_s < 5000e12


@pytest.mark.slow
def test_a_quantized_cache_is_also_measured_against_the_bound_of_its_own_bytes(tiny_qwen3_dir):
    """The bound reads the KV in the model's dtype (what an fp8 cache must beat); W1 with fp8
    KV also prints its ratio to the bound that reads fp8's single bytes."""
    from tests.bench.test_tool import nanopipe

    mc = ModelConfig.from_dir(tiny_qwen3_dir)
    fp8 = mc.with_kv_cache_dtype("fp8")
    _, wide = hardware_bound_s(mc, 1000, WORK, H100)
    _, narrow = hardware_bound_s(fp8, 1000, WORK, H100)
    assert narrow["kv_read_tb"] == pytest.approx(wide["kv_read_tb"] / mc.dtype.itemsize)
    out = nanopipe("bench", "throughput", "--model", tiny_qwen3_dir, "--device", "cpu",
                   "--num-seqs", "2", "--max-input-len", "20", "--max-output-len", "4",
                   "--kv-cache-bytes", str(4 << 20), "--modes", "runtime",
                   "--kv-cache-dtype", "fp8").stdout
    line = json.loads(next(x for x in out.splitlines() if x.startswith('{"mode"')))
    assert line["kv_dtype_bound_tok_s"] > line["hardware_bound_tok_s"]
    assert line["ratio_to_kv_dtype_bound"] <= line["ratio_to_bound"]
    assert "bound with fp8 KV reads" in out
