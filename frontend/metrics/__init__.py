"""Prometheus metrics of a pipeline: kept from the EngineStats its scheduler publishes, and
served on `/metrics` (the HTTP server's, or a port of their own with --metrics-port)."""

from frontend.metrics.engine_metrics import EngineMetrics
from frontend.metrics.server import MetricsServer
from frontend.metrics.subscriber import StatsSubscriber, follow

__all__ = ["EngineMetrics", "MetricsServer", "StatsSubscriber", "follow"]
