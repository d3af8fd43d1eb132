"""The launcher starts its first process without importing torch (one to two seconds of
start-up) when the device is the CPU or the installed torch is built for CPUs only."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from frontend.engine.torch_build import built_for_gpus, cuda_available, driver_visible_gpus

ROOT = Path(__file__).resolve().parents[2]

LAUNCHER_UP_TO_THE_FIRST_SPAWN = """
import sys
from frontend.engine.config import EngineConfig
from frontend.engine.preflight import check_config
cfg = EngineConfig(model=sys.argv[1], device=sys.argv[2] or None)
check_config(cfg)
cfg.worker_config("")
cfg.scheduler_config(64, 0, 0)
print(cfg.resolved_device, sorted(m for m in ("torch", "kernels", "transformers")
                                  if m in sys.modules))
"""


def test_the_launcher_reads_the_worker_settings_without_torch(tiny_qwen3_dir):
    for device in ("cpu", "" if not built_for_gpus() else "cpu"):
        out = subprocess.run([sys.executable, "-c", LAUNCHER_UP_TO_THE_FIRST_SPAWN,
                              tiny_qwen3_dir, device], cwd=ROOT, capture_output=True,
                             text=True, timeout=120, check=True).stdout
        assert out.split() == ["cpu", "[]"]


def test_the_build_check_agrees_with_torch():
    assert built_for_gpus() == (torch.version.cuda is not None or torch.version.hip is not None)
    assert cuda_available() == torch.cuda.is_available()


def test_the_package_still_exports_its_names():
    import gpu_workers
    from gpu_workers.config import ModelConfig, WorkerConfig
    from gpu_workers.model_runner import ModelRunner

    assert (gpu_workers.ModelConfig, gpu_workers.WorkerConfig, gpu_workers.ModelRunner) == \
        (ModelConfig, WorkerConfig, ModelRunner)


def _driver(tmp_path: Path, listed: int, nodes: int) -> tuple[Path, Path]:
    proc, dev = tmp_path / "gpus", tmp_path / "dev"
    proc.mkdir()
    dev.mkdir()
    for i in range(listed):
        (proc / f"0000:{i:02x}:00.0").mkdir()
    for i in range(nodes):
        (dev / f"nvidia{i}").touch()
    (dev / "nvidiactl").touch()
    (dev / "nvidia-uvm").touch()
    return proc, dev


@pytest.mark.parametrize(("visible", "count"), [
    (None, 4), ("0,1", 2), ("3", 1), ("", 0), ("-1", 0), ("1,-1,2", 1), ("0,7,1", 1),
    (" 2 , 3 ", 2), ("GPU-8c0d1e2f", None), ("MIG-1", None), ("0,0", None)])
def test_the_driver_says_how_many_gpus_cuda_will_show(tmp_path, visible, count):
    proc, dev = _driver(tmp_path, 4, 4)
    environ = {} if visible is None else {"CUDA_VISIBLE_DEVICES": visible}
    assert driver_visible_gpus(environ, proc, dev) == count


def test_a_driver_listing_that_disagrees_or_is_missing_leaves_it_to_torch(tmp_path):
    proc, dev = _driver(tmp_path, 8, 2)  # a container given two of the host's eight
    assert driver_visible_gpus({}, proc, dev) is None
    assert driver_visible_gpus({}, tmp_path / "no-driver", dev) is None
    empty = tmp_path / "empty"
    empty.mkdir()
    assert driver_visible_gpus({}, empty, empty) is None


def test_cuda_asked_for_without_a_gpu_is_one_line(tiny_qwen3_dir, monkeypatch):
    from frontend.engine import torch_build
    from frontend.engine.config import EngineConfig
    from frontend.engine.preflight import check_device

    monkeypatch.setattr(torch_build, "built_for_gpus", lambda: True)
    monkeypatch.setattr(torch_build, "_driver_count", lambda: 0)
    with pytest.raises(ValueError, match=r"^device 'cuda' was asked for but CUDA is not "
                                         r"available \(no visible GPU\); use --device cpu$"):
        check_device(EngineConfig(model=tiny_qwen3_dir, device="cuda"))
    monkeypatch.setattr(torch_build, "_driver_count", lambda: 2)
    with pytest.raises(ValueError, match="tensor parallel size 4 needs 4 GPUs but 2 are"):
        check_device(EngineConfig(model=tiny_qwen3_dir, device="cuda", tensor_parallel_size=4))
    check_device(EngineConfig(model=tiny_qwen3_dir, device="cuda", tensor_parallel_size=2))


@pytest.mark.gpu
def test_on_a_gpu_host_the_launcher_starts_without_torch(tiny_qwen3_dir):
    """Where the driver's listing answers, `--device` auto is cuda without importing torch."""
    assert cuda_available() == torch.cuda.is_available()
    if driver_visible_gpus() is None:
        pytest.skip("this host's driver listing does not say (torch decides here)")
    assert driver_visible_gpus() == torch.cuda.device_count()
    out = subprocess.run([sys.executable, "-c", LAUNCHER_UP_TO_THE_FIRST_SPAWN, tiny_qwen3_dir,
                          ""], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         check=True).stdout
    assert out.split() == ["cuda", "[]"]


def test_children_import_the_launchers_own_checkout():
    # The folder put first on every child's PYTHONPATH holds the packages themselves, so a
    # child imports the launcher's code, not another copy installed elsewhere.
    from frontend.engine import startup

    root = Path(startup._PACKAGE_ROOT)
    assert (root / "frontend" / "engine" / "startup.py").samefile(startup.__file__)
    assert all((root / package / "__init__.py").is_file()
               for package in ("frontend", "gpu_workers", "scheduler_proc", "protocol"))
