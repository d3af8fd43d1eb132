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
