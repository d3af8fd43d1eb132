"""A start-up that cannot finish ends every process and `nanopipe serve` exits 1 with one
line, whenever the failure strikes: here the run directory (every socket of the pipeline)
is removed under it a moment after it was made."""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from process_watch import alive, descendants, run_dir_of

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("delay_s", [0.05, 1.0])
def test_a_run_directory_removed_during_start_up_ends_everything(delay_s, tiny_qwen3_dir):
    cmd = [sys.executable, "-c",
           "import sys; from frontend.engine.cli import main; sys.exit(main())",
           "serve", tiny_qwen3_dir, "--device", "cpu", "--max-model-len", "128", "--no-http"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=ROOT)
    seen: set[int] = set()
    try:
        deadline = time.monotonic() + 60
        while (run_dir := run_dir_of(proc.pid)) is None:
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.002)
        removed_at = time.monotonic() + delay_s
        while time.monotonic() < removed_at:
            seen |= descendants(proc.pid)
            time.sleep(0.01)
        shutil.rmtree(run_dir)
        while proc.poll() is None and time.monotonic() < deadline:
            seen |= descendants(proc.pid)  # children spawned after the removal too
            time.sleep(0.01)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 1, err
    lines = [line for line in err.splitlines() if not line.startswith("nanopipe: starting")
             and "loading weights" not in line and "sizing the KV cache" not in line]
    assert lines == [f"nanopipe: the run directory {run_dir} was removed during start-up "
                     "(its sockets went with it); start again"], err
    assert "ready" not in out
    assert seen or delay_s < 1, "the workers were started by then"
    assert not [pid for pid in seen if alive(pid)]
