"""The one default of each limit that the scheduler and the workers share, and the overlap
headroom between them.

EngineConfig (frontend/engine/config.py) resolves what the user chose, or these defaults,
once, and gives every process the resolved values. The per-process configs name the same
constants as their own defaults (the CPU ones: the values a test builds by hand), so no
default is written twice.
"""

from __future__ import annotations

from dataclasses import dataclass

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
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")
"""--kv-cache-dtype: auto keeps the model's dtype; fp8 (fp8_e4m3 is the same) stores
float8_e4m3fn with a scale per layer for K and for V (kernels/kv_quant.py)."""


def canonical_kv_cache_dtype(name: str) -> str:
    """"auto" or "fp8" for a value of KV_CACHE_DTYPES; a one-line ValueError otherwise."""
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, "
                         f"got {name!r}")
    return "auto" if name == "auto" else "fp8"
DEEP_PLAN_MAX_SEQS = 32
"""With plans_ahead left to auto: the most sequences a step planned third in flight may run
(scheduler_proc.plans_in_flight states the rule this limit is part of)."""
GPU_RESULT_SPIN_S = 5e-3
"""The step loop's spin on a GPU: about a decode step, like the worker's. On a CPU the
workers compute on the host's cores, and a spinning scheduler would take one from them."""


@dataclass(frozen=True, slots=True)
class PlanDepthSettings:
    """What the depth options resolve to: the static half of the plan-depth rule, which every
    process must agree on (workers size their buffers by `plans_in_flight`). The scheduler's
    PlanDepth (scheduler_proc.plans_in_flight) applies it step by step and documents it."""

    overlap: bool
    plans_ahead: int = 1
    """With overlap: steps planned ahead of the oldest result (1 or 2)."""
    deep_plan_max_seqs: int | None = None
    """With plans_ahead 2: the deepest plan is made only for a small decode-only batch that
    the host paces (None: whenever there is room)."""
    worker_lookahead: bool = False
    """Workers take the next plan before the step in flight's tokens reach the host."""
    result_spin_s: float = 0.0
    """How long the step loop polls for a result without sleeping while one is due."""

    @property
    def plans_in_flight(self) -> int:
        """Plans sent before the oldest one's result is back. With overlap a sequence that
        step N finishes may still be computed by the plans after N (their extra tokens are
        discarded): workers size their buffers with that headroom."""
        return 1 + self.plans_ahead if self.overlap else 1


def resolve_plan_depth(plans_ahead: int | None, *, overlap: bool, lookahead: bool,
                       speculative: bool, gpu: bool) -> PlanDepthSettings:
    """The options as the user gave them (`plans_ahead` None: auto) resolved. Auto plans two
    ahead only on a GPU, with overlap and worker lookahead and without speculation, and then
    only where it pays (deep_plan_max_seqs); a 2 given explicitly applies to every step."""
    lookahead = lookahead and overlap
    spin_s = GPU_RESULT_SPIN_S if gpu else 0.0
    if plans_ahead is not None:
        return PlanDepthSettings(overlap, plans_ahead, None, lookahead, spin_s)
    deep_ok = lookahead and not speculative and gpu
    return PlanDepthSettings(overlap, 2 if deep_ok else 1, DEEP_PLAN_MAX_SEQS, lookahead, spin_s)


def plans_ahead_conflict(plans_ahead: int | None, *, speculative: bool, overlap: bool = True,
                         lookahead: bool = True) -> str | None:
    """Why `plans_ahead` cannot work with the other options (None: it can). A caller that
    does not know `overlap` or `lookahead` (the scheduler alone) leaves them True."""
    if plans_ahead is None or plans_ahead < 2:
        return None
    if not (overlap and lookahead):
        return ("> 1 needs overlap and worker lookahead (a worker that launches a step "
                "before the previous one's tokens are back)")
    if speculative:
        return ("> 1 does not go with speculative decoding (a step's accepted tokens decide "
                "the next plan's positions)")
    return None


def plans_in_flight(overlap: bool, plans_ahead: int = 1) -> int:
    """The most plans in flight for these options (PlanDepthSettings.plans_in_flight)."""
    return PlanDepthSettings(overlap, plans_ahead).plans_in_flight


MAX_CLIENT_KEY_CHARS = 64
"""Longest client key a request may name (GenerateRequest.client_key): a name, not data."""
