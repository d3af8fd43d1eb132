"""`python -m frontend.top ADDRESS` (`nanopipe-top`): a live terminal view of a running
pipeline, built from what its scheduler publishes on `deltas_pub` (EngineStats and each
step's TokenDeltas); watching never slows the engine."""

from frontend.top.render import render
from frontend.top.state import RequestView, TopState, TopView

__all__ = ["RequestView", "TopState", "TopView", "render"]
