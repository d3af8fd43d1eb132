"""frontend.bench.common.model_source as the workloads use it: the model source and W1 options
parse as documented, and --make-random builds a model directory that is gone when the process
exits (unless it was given a place to keep it)."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # builds models for the benchmark tool

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def cli(monkeypatch, tmp_path):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the temp dirs it makes land here
    from frontend.bench.common import model_source

    return model_source


def parser(cli, **source) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="bench")
    cli.add_model_source(ap, **source)
    cli.add_w1_shape(ap)
    return ap


def test_one_model_source_and_the_w1_defaults(cli, capsys, tmp_path):
    (tmp_path / "config.json").write_text("{}")
    args = parser(cli).parse_args(["--model", str(tmp_path)])
    assert (args.model, args.make_random, args.device) == (str(tmp_path), None, None)
    assert (args.num_seqs, args.max_input_len, args.max_output_len, args.max_num_seqs,
            args.max_num_batched_tokens) == (256, 1024, 1024, 256, 16384)
    assert cli.resolve_model_dir(args, "cpu") == str(tmp_path)
    for argv, says in (([], "one of the arguments --model --make-random is required"),
                       (["--model", "D", "--make-random", "qwen3-8b"], "not allowed with"),
                       (["--make-random", "qwen3-9b"], "argument --make-random: invalid choice")):
        with pytest.raises(SystemExit):
            parser(cli).parse_args(argv)
        assert says in capsys.readouterr().err


def test_optional_source_out_and_device_default(cli):
    ap = parser(cli, required=False, device_default="cuda", out=True)
    args = ap.parse_args([])
    assert (args.model, args.make_random, args.out, args.device) == (None, None, None, "cuda")
    assert cli.resolve_model_dir(args, "cpu") is None  # the workload's own default model
    assert "(default: embedded model)" in " ".join(ap.format_help().split())
    narrow = argparse.ArgumentParser()
    cli.add_w1_shape(narrow, batched_tokens=False)
    assert not hasattr(narrow.parse_args([]), "max_num_batched_tokens")


def test_make_random_builds_a_model_dir_in_a_temp_dir(cli, tmp_path, capsys):
    from gpu_workers import ModelConfig
    from protocol.model_config import max_position_embeddings, read_model_config

    args = parser(cli).parse_args(["--make-random", "smollm2-135m"])
    args.max_model_len = 16384  # as the throughput and latency workloads take it
    model_dir = Path(cli.resolve_model_dir(args, "cpu", tokenizer=True))
    assert model_dir.parent == tmp_path and model_dir.name.startswith("nanopipe-smollm2-135m-")
    assert ModelConfig.from_dir(str(model_dir)).num_layers == 30
    assert (model_dir / "tokenizer.json").is_file()
    # The shape's own limit is 8192: a longer --max-model-len raises the config's, and says so.
    assert max_position_embeddings(read_model_config(str(model_dir))) == 16384
    out = capsys.readouterr().out
    assert "random smollm2-135m weights built in " in out
    assert "max_position_embeddings raised from 8192 to 16384" in out


_RESOLVE = """
import sys
from frontend.bench.common import model_source as cli
import argparse
ap = argparse.ArgumentParser()
cli.add_model_source(ap)
model_dir = cli.resolve_model_dir(ap.parse_args(sys.argv[2:]), sys.argv[1])
print("MODEL_DIR=" + model_dir, flush=True)
"""


@pytest.mark.parametrize("device", ["cpu", "no-such-device"])
def test_a_temp_model_dir_is_gone_when_the_process_exits(tmp_path, device):
    """Built or not (a failed build), nothing is left behind: the 8B shape fills 16 GB."""
    env = {**os.environ, "TMPDIR": str(tmp_path),
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", _RESOLVE, device, "--make-random",
                           "smollm2-135m"], env=env, capture_output=True, text=True, timeout=300)
    if device == "cpu":
        assert proc.returncode == 0, proc.stderr
        built = Path(proc.stdout.split("MODEL_DIR=", 1)[1].strip())
        assert built.parent == tmp_path and built.name.startswith("nanopipe-smollm2-135m-")
    else:
        assert proc.returncode != 0 and "no-such-device" in proc.stderr
    assert list(tmp_path.iterdir()) == []


def test_out_is_kept(cli, tmp_path):
    args = parser(cli).parse_args(["--make-random", "smollm2-135m"])
    kept = tmp_path / "kept"
    assert cli.resolve_model_dir(args, "cpu", kept) == str(kept)
    assert (kept / "config.json").is_file()


def test_a_model_dir_without_a_config_is_refused_in_one_line(cli, tmp_path):
    args = parser(cli).parse_args(["--model", str(tmp_path / "missing")])
    with pytest.raises(SystemExit) as exc:
        cli.resolve_model_dir(args, "cpu")
    assert str(exc.value) == (f"--model {tmp_path / 'missing'}: no config.json there "
                              "(a Hugging Face model directory is expected)")
