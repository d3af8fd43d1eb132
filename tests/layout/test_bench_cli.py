"""benchlib.cli as the benchmark scripts use it: the model source and W1 options parse as the
scripts document, and --make-random builds a model directory (and leaves nothing behind when
the build fails)."""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def cli(monkeypatch, tmp_path):
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the temp dirs it makes land here
    from benchlib import cli

    return cli


def parser(cli, **source) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="bench")
    cli.add_model_source(ap, **source)
    cli.add_w1_shape(ap)
    return ap


def test_one_model_source_and_the_w1_defaults(cli, capsys):
    args = parser(cli).parse_args(["--model", "DIR"])
    assert (args.model, args.make_random, args.device) == ("DIR", None, None)
    assert (args.num_seqs, args.max_input_len, args.max_output_len, args.max_num_seqs,
            args.max_num_batched_tokens) == (256, 1024, 1024, 256, 16384)
    assert cli.resolve_model_dir(args, "cpu") == "DIR"
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
    assert cli.resolve_model_dir(args, "cpu") is None  # the script's own default model
    assert "(default: embedded model)" in " ".join(ap.format_help().split())
    narrow = argparse.ArgumentParser()
    cli.add_w1_shape(narrow, batched_tokens=False)
    assert not hasattr(narrow.parse_args([]), "max_num_batched_tokens")


def test_make_random_builds_a_model_dir_in_a_temp_dir(cli, tmp_path, capsys):
    from gpu_workers import ModelConfig

    args = parser(cli).parse_args(["--make-random", "smollm2-135m"])
    model_dir = Path(cli.resolve_model_dir(args, "cpu", tokenizer=True))
    assert model_dir.parent == tmp_path and model_dir.name.startswith("nanopipe-smollm2-135m-")
    assert ModelConfig.from_dir(str(model_dir)).num_layers == 30
    assert (model_dir / "tokenizer.json").is_file()
    assert "random smollm2-135m weights built in " in capsys.readouterr().out


def test_a_failed_build_leaves_no_temp_dir(cli, tmp_path):
    args = parser(cli).parse_args(["--make-random", "smollm2-135m"])
    with pytest.raises(RuntimeError):
        cli.resolve_model_dir(args, "no-such-device")
    assert list(tmp_path.iterdir()) == []
