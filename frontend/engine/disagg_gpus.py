"""Which GPUs a disaggregated pipeline's workers see, and whether KV can move between them
through shared pools (--kv-transfer shared; docs/disaggregation.md).

With a GPU group per replica (tp GPUs each, replica i the i-th group of those visible) a
frames pipeline shows each worker its own group only, as --dp does. A shared one shows each
worker every group, its own first: a decode rank can open a CUDA IPC handle only for memory
on a device its process sees. Its own group first keeps what a worker does with device
indices as it was: `torch.cuda.set_device(rank % count)` picks its own GPU, and the ranks of
one tensor-parallel group number their GPUs alike. The decode rank of index r reads the
prefill rank r's pool over NVLink, which needs peer access from its GPU to that one.
"""

from __future__ import annotations

import functools
from collections.abc import Callable


def worker_gpus(devices: list[str], tp: int, replicas: int, replica: int,
                see_all: bool) -> list[str]:
    """CUDA_VISIBLE_DEVICES for `replica`'s workers, one group of `tp` of `devices` per
    replica: its own group, then (`see_all`) every other replica's group in replica order."""
    groups = [devices[i * tp:(i + 1) * tp] for i in range(replicas)]
    own = groups[replica]
    if not see_all:
        return own
    return own + [d for i, g in enumerate(groups) if i != replica for d in g]


def reading_pairs(tp: int, prefill: int, decode: int) -> list[tuple[int, int]]:
    """(decode GPU, prefill GPU) for every pair of ranks whose KV moves, as indices into the
    launcher's visible GPUs: rank r of each decode replica reads rank r of each prefill one."""
    return [((prefill + d) * tp + r, p * tp + r)
            for p in range(prefill) for d in range(decode) for r in range(tp)]


def peer_obstacle(devices: list[str], pairs: list[tuple[int, int]],
                  can_access: Callable[[int, int], bool]) -> str | None:
    """Why shared pools cannot work between these GPUs (None: they can): the first decode
    GPU that cannot read its prefill GPU's memory directly."""
    for reader, owner in pairs:
        if not can_access(reader, owner):
            return (f"GPU {devices[reader]} (a decode rank's) has no peer access to GPU "
                    f"{devices[owner]} (its prefill rank's)")
    return None


@functools.cache
def can_access_peer(reader: int, owner: int) -> bool:
    """Whether GPU `reader` can read GPU `owner`'s memory directly (NVLink or PCIe peer
    access). Asks the driver without a context on either device."""
    import torch

    try:
        return bool(torch.cuda.can_device_access_peer(reader, owner))
    except (AssertionError, RuntimeError):  # no CUDA here: nothing to read across
        return False
