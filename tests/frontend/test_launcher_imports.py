"""The launcher starts its first process without importing torch (one to two seconds of
start-up) when the device is the CPU or the installed torch is built for CPUs only."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch

from frontend.engine.torch_build import built_for_gpus, cuda_available

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
