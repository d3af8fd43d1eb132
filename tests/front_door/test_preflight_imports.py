"""The launcher's checks import no torch, and refuse a model in the workers' own words.

A CPU start-up then pays nothing for torch before its processes start, and no signal can
land inside torch's C start-up in the launcher. The checks run in a fresh interpreter (this
one has torch loaded); the workers' errors are computed here, with torch, for comparison.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from gpu_workers.config import ModelConfig

ROOT = Path(__file__).resolve().parents[2]
# The checks Pipeline.start makes (NodeRanks.start makes a subset), on each (model, tp).
CHECKS = """
import json, sys
from frontend.engine.config import EngineConfig
from frontend.engine.preflight import check_config

errors = []
for model, tp in json.loads(sys.argv[1]):
    try:
        check_config(EngineConfig(model=model, device="cpu", tensor_parallel_size=tp))
        errors.append(None)
    except ValueError as exc:
        errors.append(str(exc))
loaded = sorted(m for m in ("torch", "gpu_workers", "kernels") if m in sys.modules)
print(json.dumps({"errors": errors, "loaded": loaded}))
"""


def _run_checks(cases: list[tuple[str, int]]) -> dict:
    done = subprocess.run([sys.executable, "-c", CHECKS, json.dumps(cases)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def _model_with(tmp_path: Path, name: str, base: str, **changes: object) -> str:
    """A directory holding only `base`'s config.json, changed (None drops a field)."""
    cfg = json.loads((Path(base) / "config.json").read_text())
    cfg.update(changes)
    cfg = {k: v for k, v in cfg.items() if v is not None}
    folder = tmp_path / name
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(cfg))
    return str(folder)


def _worker_error(model: str, tp: int) -> str:
    """What a worker says loading `model` for `tp` ranks."""
    with pytest.raises(ValueError) as info:
        ModelConfig.from_dir(model).head_shards(tp)
    return str(info.value)


def test_checks_import_no_torch_and_say_what_the_workers_say(tiny_qwen3_dir, tmp_path):
    bad = {
        "tp beyond the heads": (tiny_qwen3_dir, 64),
        "unsupported type": (_model_with(tmp_path, "gpt2", tiny_qwen3_dir, model_type="gpt2"), 1),
        "unsupported dtype": (_model_with(tmp_path, "int8", tiny_qwen3_dir, dtype="int8"), 1),
        "heads not in groups": (_model_with(tmp_path, "9q4kv", tiny_qwen3_dir,
                                            num_attention_heads=9, num_key_value_heads=4), 1),
        "missing field": (_model_with(tmp_path, "nofield", tiny_qwen3_dir,
                                      intermediate_size=None), 1),
    }
    got = _run_checks([(tiny_qwen3_dir, 1), (tiny_qwen3_dir, 2), *bad.values()])
    assert got["loaded"] == [], f"the launcher's checks imported {got['loaded']}"
    assert got["errors"][:2] == [None, None]
    errors = dict(zip(bad, got["errors"][2:]))
    assert errors["tp beyond the heads"] == (
        "tensor-parallel size must be between 1 and the model's 4 attention heads, got 64")
    assert errors["unsupported type"] == (
        "model_type 'gpt2' is not supported (supported: ('llama', 'qwen2', 'qwen3'))")
    assert errors["unsupported dtype"].startswith("dtype must be one of [")
    assert errors["unsupported dtype"].endswith("got 'int8'")
    assert errors["heads not in groups"] == (
        "num_attention_heads (9) must be a positive multiple of num_key_value_heads (4)")
    nofield = bad["missing field"][0]
    assert errors["missing field"] == f"model {nofield!r}: config.json lacks 'intermediate_size'"
    # The same words as the workers', from the same code (protocol.model_shape).
    for case, (model, tp) in bad.items():
        assert errors[case].endswith(_worker_error(model, tp)), case
