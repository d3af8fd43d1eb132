"""What the hardening tests share: the engine they attack and the reference request (a plain
module: test files import it by name)."""

from __future__ import annotations

from protocol import (
    SamplingParams,
)

ENGINE = dict(device="cpu", dtype="float32", max_model_len=256, max_num_seqs=16,
              max_num_batched_tokens=512)
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
PROMPT = "The engine still answers"
MAX_REQUEST_BYTES = 200_000
"""The HTTP body cap of the `base_url` server (413 tests)."""
