"""The one fast whole-engine check of prefill/decode disaggregation (the rest is slow-marked
in test_disaggregated.py): a request's first token comes from the prefill replica, the rest
from the decode replica after its KV moved (by default on the CPU through shared pools), and the
stream is one ordinary request."""

from __future__ import annotations

import os
from pathlib import Path

from pipeline_config import tiny_engine

from frontend import LLM
from protocol import SamplingParams


def memfds(pid: int) -> list[str]:
    """The memfds process `pid` holds open."""
    fds = Path(f"/proc/{pid}/fd")
    return [link for link in (os.readlink(p) for p in fds.iterdir()) if link.startswith("/memfd:")]


def test_a_request_is_handed_over_and_streams_as_one(tiny_qwen3_dir):
    prompt = [(7 * j) % 300 + 2 for j in range(40)]
    with LLM(**tiny_engine(tiny_qwen3_dir, prefill_replicas=1, decode_replicas=1)) as llm:
        # On the CPU the KV moves through shared pools by default: the prefill rank's pool
        # lives in a memfd its decode peer maps.
        prefill_rank = next(c for c in llm.pipeline.children
                            if c.role == "worker" and c.replica == 0)
        assert "/memfd:nanopipe-kv-pool (deleted)" in memfds(prefill_rank.proc.pid)
        whole, first = llm.generate(
            [prompt, prompt], [SamplingParams(temperature=0, max_tokens=10, ignore_eos=True),
                               SamplingParams(temperature=0, max_tokens=1)], use_tqdm=False)
    assert len(whole["token_ids"]) == 10 and whole["finish_reason"] == "length"
    assert whole["token_ids"][:1] == first["token_ids"]
    m = whole["metrics"]
    assert m.kv_transfer_s is not None and m.generated_tokens == 10 and m.ttft_s < m.e2e_s
    assert first["metrics"].kv_transfer_s is None  # ended by its first token: never moved
