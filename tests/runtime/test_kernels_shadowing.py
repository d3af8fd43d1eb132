"""A foreign package named `kernels` first on sys.path is reported, not silently used."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("module", ["gpu_workers.ops", "gpu_workers.config"])
def test_foreign_kernels_package_is_refused_with_a_clear_message(tmp_path, module):
    fake = tmp_path / "kernels"
    fake.mkdir()
    (fake / "__init__.py").write_text("def get_kernel(name):\n    raise NotImplementedError\n")
    code = f"import sys; sys.path[:0] = [sys.argv[1], sys.argv[2]]; import {module}"
    proc = subprocess.run([sys.executable, "-c", code, str(tmp_path), str(ROOT)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "shadows it" in proc.stderr
    assert "pip uninstall kernels" in proc.stderr


def test_our_kernels_package_is_the_one_imported():
    import kernels

    assert kernels.NANOPIPE_KERNELS
    assert Path(kernels.__file__).resolve().parent == ROOT / "kernels"
