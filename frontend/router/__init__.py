"""The data-parallel router: which replica (a scheduler and its workers) gets each request.

It runs inside the tokenizer actor, the one place every request passes with its token ids,
so placing a request costs no extra hop. `placement` decides (load and prefix affinity),
`prefix_summary` remembers which replica got which prompt blocks, `dispatch` owns the
sockets to the replicas.
"""

from frontend.router.config import ROUTING_POLICIES, RouterConfig
from frontend.router.placement import Router

__all__ = ["ROUTING_POLICIES", "Router", "RouterConfig"]
