"""Start-up's bulk copies on one CPU thread.

Loading the weights and reordering them for oneDNN are memory copies that torch splits over
its intra-op threads. On a machine whose cores other processes also use, each parallel
region waits for its slowest thread, and a thread that loses its core for a time slice
stalls the whole copy: on two shared cores (load average 2.3 to 2.5) the SmolLM2-135M load
and reorder took 0.9 to 3.6 s with two threads and 0.6 to 0.9 s with one. The steps keep
every thread.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """Run the block with one intra-op thread, then restore the count it had."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(previous)
