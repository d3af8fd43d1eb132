"""A checkpoint's safetensors files, and each tensor's name, shape and dtype from the headers.

The launcher reads these before any process starts, so that a truncated or corrupt file, or
an index naming a shard that is not there, is one line naming the file rather than a worker's
traceback seconds into loading. Opening a file with safetensors maps it and validates its
header (JSON, known dtypes, offsets that tile the data exactly); no tensor is read. The
workers list the same files through `checkpoint_files`. No torch: the launcher imports this.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from safetensors import SafetensorError, safe_open

INDEX_FILE = "model.safetensors.index.json"
SUFFIX = ".safetensors"


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded; the message names the file and what is wrong."""


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """One tensor as its file's header describes it."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    file: str
    """The name of the safetensors file that holds it."""


def checkpoint_files(model_dir: str | Path) -> list[Path]:
    """The safetensors files of `model_dir`: those its index names, else every *.safetensors.

    CheckpointError when the index is unreadable or names a shard that is not a file of the
    directory, or when there is no safetensors file at all."""
    root = Path(model_dir)
    index = root / INDEX_FILE
    if index.is_file():
        return [_shard(root, name) for name in sorted(set(_weight_map(index).values()))]
    files = sorted(p for p in root.glob(f"*{SUFFIX}") if p.is_file())
    if not files:
        raise CheckpointError(f"model directory {str(model_dir)!r} has no *{SUFFIX} file "
                              "(nanopipe loads safetensors checkpoints only)")
    return files


def _weight_map(index: Path) -> dict[str, str]:
    """The index's tensor -> shard map, checked to be one."""
    try:
        value = json.loads(index.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{index.name} is not readable JSON: {exc}") from None
    weight_map = value.get("weight_map") if isinstance(value, dict) else None
    if not isinstance(weight_map, dict) or not weight_map or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()):
        raise CheckpointError(f"{index.name} lacks a 'weight_map' of tensor names to shard "
                              "file names")
    return weight_map


def _shard(root: Path, name: str) -> Path:
    """The shard file `name` in `root`: a plain file name, present."""
    if Path(name).name != name or not name.endswith(SUFFIX):
        raise CheckpointError(f"{INDEX_FILE} names shard {name!r}, which is not a "
                              f"*{SUFFIX} file name in the model directory")
    path = root / name
    if not path.is_file():
        raise CheckpointError(f"{INDEX_FILE} names shard {name!r}, which is not in the "
                              "model directory")
    return path


def read_header(path: Path) -> list[TensorSpec]:
    """The tensors `path` holds, from its header alone; CheckpointError naming the file when
    it is no valid safetensors file (truncated, empty, bad header, offsets or dtypes)."""
    try:
        with safe_open(str(path), framework="numpy") as f:
            specs = []
            for name in f.keys():
                info = f.get_slice(name)
                specs.append(TensorSpec(name, tuple(info.get_shape()), info.get_dtype(),
                                        path.name))
            return specs
    except (SafetensorError, OSError) as exc:
        reason = str(exc).removeprefix("Error while deserializing header: ").splitlines()[0]
        raise CheckpointError(f"{path.name} is not a valid safetensors file ({reason})") \
            from None


def read_tensor_specs(model_dir: str | Path) -> dict[str, TensorSpec]:
    """Every tensor of the checkpoint in `model_dir` by name, from the headers.

    CheckpointError for a corrupt file, a tensor held by two files, or an index that places
    a tensor in a shard which does not hold it."""
    root = Path(model_dir)
    specs: dict[str, TensorSpec] = {}
    for path in checkpoint_files(root):
        for spec in read_header(path):
            if spec.name in specs:
                raise CheckpointError(f"tensor {spec.name!r} is in both "
                                      f"{specs[spec.name].file} and {spec.file}")
            specs[spec.name] = spec
    index = root / INDEX_FILE
    if index.is_file():
        for name, shard in _weight_map(index).items():
            if name not in specs or specs[name].file != shard:
                raise CheckpointError(f"{INDEX_FILE} places tensor {name!r} in {shard}, "
                                      "which does not hold it")
    return specs
