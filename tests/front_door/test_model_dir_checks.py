"""A model directory that does not hold what it claims is refused before any process is
ready or has said a word, in one line naming the file or field, by `nanopipe serve` (exit 1)
and by `LLM(...)`: a config.json that disagrees with its checkpoint, a corrupt safetensors
file, a missing or broken tokenizer, a bad draft model. (The model files are checked beside
the workers' spawns, which a failed check stops: no process is left behind.)"""

from __future__ import annotations

import json
import shutil
import struct
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from frontend.engine.llm import LLM
from frontend.engine.options import ConfigError
from frontend.engine.startup import StartupError
from frontend.engine.usage import EXIT_FAILED
from protocol import SamplingParams

ROOT = Path(__file__).resolve().parents[2]
WEIGHTS = "model.safetensors"


def _serve(model: str, *flags: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-c", "import sys; from frontend.engine.cli import main; "
           "sys.exit(main())", "serve", model, "--device", "cpu", "--no-http", *flags]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT)


def _refused(done: subprocess.CompletedProcess) -> str:
    """The one stderr line of a start-up refused before anything started."""
    assert done.returncode == EXIT_FAILED, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, done.stderr
    assert "Traceback" not in done.stderr and "starting" not in done.stderr
    assert "ready" not in done.stdout
    return lines[0]


def _copy(src: str, dst: Path, edit: Callable[[Path], None]) -> str:
    shutil.copytree(src, dst)
    edit(dst)
    return str(dst)


def _set_config(**fields) -> Callable[[Path], None]:
    def edit(model: Path) -> None:
        path = model / "config.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), **fields}))
    return edit


def _split(path: Path) -> tuple[dict, bytes]:
    """A safetensors file's header (as JSON) and its data bytes."""
    raw = path.read_bytes()
    (size,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8:8 + size]), raw[8 + size:]


def _with_header(edit_header: Callable[[dict], None]) -> Callable[[Path], None]:
    def edit(model: Path) -> None:
        header, data = _split(model / WEIGHTS)
        edit_header(header)
        text = json.dumps(header).encode()
        (model / WEIGHTS).write_bytes(struct.pack("<Q", len(text)) + text + data)
    return edit


def _first_tensor(header: dict) -> dict:
    return header[next(k for k in sorted(header) if k != "__metadata__")]


def _write(raw: Callable[[bytes], bytes]) -> Callable[[Path], None]:
    def edit(model: Path) -> None:
        (model / WEIGHTS).write_bytes(raw((model / WEIGHTS).read_bytes()))
    return edit


def _index_naming_a_missing_shard(model: Path) -> None:
    header, _ = _split(model / WEIGHTS)
    names = [k for k in header if k != "__metadata__"]
    (model / WEIGHTS).rename(model / "model-00001-of-00002.safetensors")
    weight_map = {n: "model-00001-of-00002.safetensors" for n in names}
    weight_map[names[0]] = "model-00002-of-00002.safetensors"
    (model / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))


def _offsets_outside(header: dict) -> None:
    _first_tensor(header)["data_offsets"][1] = 10**9


def _unknown_dtype(header: dict) -> None:
    _first_tensor(header)["dtype"] = "F17"


def _shape_against_offsets(header: dict) -> None:
    _first_tensor(header)["shape"] = [3, 3]


MISMATCHED_CONFIGS = {
    "a million layers over two": (_set_config(num_hidden_layers=10**6),
                                  "config.json's num_hidden_layers is 1000000 but the "
                                  "checkpoint holds weights for 2 layers"),
    "fewer layers than the checkpoint": (_set_config(num_hidden_layers=1),
                                         "num_hidden_layers is 1 but the checkpoint holds "
                                         "weights for 2 layers"),
    "a smaller intermediate_size": (_set_config(intermediate_size=100),
                                    "is [64, 128] but config.json's hidden_size, "
                                    "intermediate_size make it [64, 100]"),
    "a negative intermediate_size": (_set_config(intermediate_size=-128),
                                     "config.json's 'intermediate_size' must be a positive "
                                     "integer, got -128"),
    "another vocab_size": (_set_config(vocab_size=700),
                           "model.embed_tokens.weight in model.safetensors is [688, 64] but "
                           "config.json's vocab_size, hidden_size make it [700, 64]"),
    "untied embeddings without an lm_head": (_set_config(tie_word_embeddings=False),
                                             "the checkpoint lacks lm_head.weight"),
}

CORRUPT_CHECKPOINTS = {
    "truncated": (_write(lambda raw: raw[:len(raw) // 2]), "file not fully covered"),
    "bad header length": (_write(lambda raw: struct.pack("<Q", 2**40) + raw[8:]),
                          "header too large"),
    "header not JSON": (_write(lambda raw: raw[:8] + b"{" * 20 + raw[28:]),
                        "invalid JSON in header"),
    "offsets outside the file": (_with_header(_offsets_outside), "offset"),
    "unknown dtype": (_with_header(_unknown_dtype), "unknown variant `F17`"),
    "shape against offsets": (_with_header(_shape_against_offsets),
                              "invalid shape, data type, or offset"),
    "empty file": (_write(lambda raw: b""), "header too small"),
}


@pytest.mark.parametrize("case", list(MISMATCHED_CONFIGS))
def test_a_config_that_is_not_its_checkpoint_is_one_line(case, tiny_qwen3_dir, tmp_path):
    edit, expected = MISMATCHED_CONFIGS[case]
    model = _copy(tiny_qwen3_dir, tmp_path / "model", edit)
    line = _refused(_serve(model))
    assert line.startswith(f"nanopipe: model {model!r}: ") and expected in line, line
    with pytest.raises(StartupError, match=expected.replace("[", r"\[")):
        LLM(model, device="cpu")


@pytest.mark.parametrize("case", list(CORRUPT_CHECKPOINTS))
def test_a_corrupt_safetensors_file_is_one_line_naming_it(case, tiny_qwen3_dir, tmp_path):
    edit, expected = CORRUPT_CHECKPOINTS[case]
    model = _copy(tiny_qwen3_dir, tmp_path / "model", edit)
    line = _refused(_serve(model))
    assert f"{WEIGHTS} is not a valid safetensors file (" in line and expected in line, line
    with pytest.raises(StartupError, match=f"{WEIGHTS} is not a valid safetensors file"):
        LLM(model, device="cpu")


def _index_not_json(model: Path) -> None:
    (model / "model.safetensors.index.json").write_text("{oops")


def _index_outside_the_directory(model: Path) -> None:
    header, _ = _split(model / WEIGHTS)
    weight_map = {n: "../model.safetensors" for n in header if n != "__metadata__"}
    (model / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))


@pytest.mark.parametrize("edit, expected", [
    (_index_naming_a_missing_shard, "model.safetensors.index.json names shard "
     "'model-00002-of-00002.safetensors', which is not in the model directory"),
    (_index_not_json, "model.safetensors.index.json is not readable JSON"),
    (_index_outside_the_directory, "names shard '../model.safetensors', which is not a "
     "*.safetensors file name in the model directory"),
])
def test_a_broken_index_is_one_line(edit, expected, tiny_qwen3_dir, tmp_path):
    model = _copy(tiny_qwen3_dir, tmp_path / "model", edit)
    line = _refused(_serve(model))
    assert expected in line, line


def test_a_sharded_checkpoint_that_matches_its_index_passes_the_checks(tiny_qwen3_dir,
                                                                      tmp_path):
    """The checks refuse what is wrong, not what is sharded: two shards and their index."""
    from safetensors.torch import load_file, save_file

    model = tmp_path / "model"
    shutil.copytree(tiny_qwen3_dir, model)
    tensors = load_file(model / WEIGHTS)
    (model / WEIGHTS).unlink()
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2],
              "model-00002-of-00002.safetensors": names[1::2]}
    for shard, part in shards.items():
        save_file({n: tensors[n] for n in part}, model / shard)
    weight_map = {n: shard for shard, part in shards.items() for n in part}
    (model / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    outputs = []
    for path in (tiny_qwen3_dir, str(model)):
        with LLM(path, device="cpu", max_model_len=64) as llm:
            outputs.append(llm.generate([[1, 2, 3]], greedy, use_tqdm=False)[0]["token_ids"])
    assert outputs[0] == outputs[1] and len(outputs[0]) == 8


def test_a_directory_without_tokenizer_files_is_one_line(tiny_qwen3_dir, tmp_path):
    def drop(model: Path) -> None:
        (model / "tokenizer.json").unlink()
        (model / "tokenizer_config.json").unlink()
    model = _copy(tiny_qwen3_dir, tmp_path / "model", drop)
    line = _refused(_serve(model))
    assert f"model directory {model!r} has no tokenizer files (tokenizer.json" in line
    with pytest.raises(StartupError, match="has no tokenizer files"):
        LLM(model, device="cpu")
    assert _child_pids() == set()  # the workers spawned beside the check were stopped


def _child_pids() -> set[int]:
    return {int(pid) for task in Path("/proc/self/task").iterdir()
            for pid in (task / "children").read_text().split()}


@pytest.mark.parametrize("text, expected", [
    ("{not json", "key must be a string"),
    ("", "EOF while parsing"),
    ('{"version": "1.0", "model": 5}', "did not match any variant"),
    (None, "it lacks the 'added_tokens' list"),
])
def test_an_invalid_tokenizer_json_is_one_line(text, expected, tiny_qwen3_dir, tmp_path):
    def spoil(model: Path) -> None:
        path = model / "tokenizer.json"
        if text is None:  # parses for the tokenizers library, not for transformers
            whole = json.loads(path.read_text())
            del whole["added_tokens"]
            path.write_text(json.dumps(whole))
        else:
            path.write_text(text)
    model = _copy(tiny_qwen3_dir, tmp_path / "model", spoil)
    line = _refused(_serve(model))
    assert f"{model}/tokenizer.json is not a valid tokenizer: " in line and expected in line
    with pytest.raises(StartupError, match="tokenizer.json is not a valid tokenizer: "):
        LLM(model, device="cpu")


@pytest.mark.parametrize("case, expected", [
    ("truncated", "model.safetensors is not a valid safetensors file (incomplete metadata"),
    ("layers", "config.json's num_hidden_layers is 1000000 but the checkpoint holds"),
    ("type", "model_type 'gpt2' is not supported"),
    ("no weights", "has no *.safetensors file"),
])
def test_a_bad_draft_model_is_one_line_naming_the_flag(case, expected, tiny_qwen3_dir,
                                                       tmp_path):
    edits = {"truncated": CORRUPT_CHECKPOINTS["truncated"][0],
             "layers": _set_config(num_hidden_layers=10**6),
             "type": _set_config(model_type="gpt2"),
             "no weights": lambda model: (model / WEIGHTS).unlink()}
    draft = _copy(tiny_qwen3_dir, tmp_path / "draft", edits[case])
    line = _refused(_serve(tiny_qwen3_dir, "--speculative", "draft", "--draft-model", draft))
    assert line.startswith(f"nanopipe: EngineConfig.draft_model {draft!r}: "), line
    assert expected in line, line
    with pytest.raises(ConfigError) as refused:
        LLM(tiny_qwen3_dir, device="cpu", speculative="draft", draft_model=draft)
    assert refused.value.field == "draft_model" and expected in str(refused.value)


@pytest.mark.parametrize("text, expected", [
    ("{oops", "tokenizer_config.json is not valid JSON: "),
    ("[1]", "tokenizer_config.json must hold a JSON object, got list"),
])
def test_an_invalid_tokenizer_config_is_one_line(text, expected, tiny_qwen3_dir, tmp_path):
    model = _copy(tiny_qwen3_dir, tmp_path / "model",
                  lambda m: (m / "tokenizer_config.json").write_text(text))
    assert expected in _refused(_serve(model))
