"""The one default of each limit that the scheduler and the workers share, and the overlap
headroom between them.

EngineConfig (frontend/engine/config.py) resolves what the user chose, or these defaults,
once, and gives every process the resolved values. The per-process configs name the same
constants as their own defaults (the CPU ones: the values a test builds by hand), so no
default is written twice.
"""

from __future__ import annotations

MAX_NUM_SEQS = 256
MAX_MODEL_LEN_CAP = 4096
"""With no max_model_len given: the model's own limit, capped at this."""
BLOCK_SIZE = {"cuda": 256, "cpu": 16}
"""Tokens per KV block. 256 on cuda keeps block tables short (flash-attn's paged KV needs it)."""
FLASH_BLOCK_MULTIPLE = 256
"""flash-attn's paged kernels take blocks of a multiple of this many tokens."""
MAX_NUM_BATCHED_TOKENS = {"cuda": 16384, "cpu": 2048}
CPU_KV_CACHE_BYTES = 512 << 20
"""The KV cache's size on cpu unless kv_cache_bytes says otherwise (cuda sizes it from the
memory left after a profiling run)."""
ATTENTION_BACKENDS = ("auto", "flash_attn", "triton", "torch")
DEEP_PLAN_MAX_SEQS = 32
"""With plans_ahead left to auto on a GPU: the scheduler plans a second step ahead only while at
most this many sequences run, all decoding and none waiting, and only where the host's chain
from a step's tokens to the launch of the next (two hops, the plan, the launch) is measured to
be longer than the device's step (scheduler_proc.plans_in_flight): planning one more step
ahead hides it. Where the device paces, the extra plan would only delay a new prompt by a step."""


def plans_in_flight(overlap: bool, plans_ahead: int = 1) -> int:
    """Plans the scheduler sends before the oldest one's result is back.

    With overlap it plans step N+1 while N runs (and N+2 too with plans_ahead=2), so a
    sequence that step N finishes may still be computed by the plans after N (their extra
    tokens are discarded): workers size their buffers with that headroom, taken from this
    number rather than from constants of theirs.
    """
    return 1 + plans_ahead if overlap else 1

MAX_CLIENT_KEY_CHARS = 64
"""Longest client key a request may name (GenerateRequest.client_key): a name, not data."""
