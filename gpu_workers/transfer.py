"""Host-to-device copies that do not block the host."""

from __future__ import annotations

import numpy as np
import torch


def to_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """Copy a host array to the device. On CUDA it is staged in pinned memory, whose caching
    allocator keeps it alive until the copy has run, so the call returns at once."""
    host = torch.from_numpy(np.ascontiguousarray(array))
    if device.type == "cuda":
        host = host.pin_memory()
    return host.to(device, non_blocking=True)


def upload(parts: list[np.ndarray], device: torch.device) -> list[torch.Tensor]:
    """Int32 arrays to the device in one copy (to_device), as views of one buffer.

    Every segment starts 16-byte aligned: Triton specialises kernels on pointer alignment,
    and a varying alignment would compile new kernel variants in the middle of serving."""
    sizes = [len(p) for p in parts]
    padded = [-(-n // 4) * 4 for n in sizes]
    flat = np.zeros(sum(padded), np.int32)
    offset = 0
    for p, n, pn in zip(parts, sizes, padded, strict=True):
        flat[offset:offset + n] = p
        offset += pn
    dev = to_device(flat, device)
    return [v[:n] for v, n in zip(dev.split(padded), sizes, strict=True)]
