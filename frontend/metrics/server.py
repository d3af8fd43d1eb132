"""`--metrics-port`: the Prometheus text format on its own port, for pipelines without HTTP.

The port is bound when the server is made (before the engine starts), so a port in use is a
one-line error at once; scrapes are answered from a thread of the launcher. Its listen
backlog is the system's maximum, not http.server's 5: a burst of scrapers (or of anything
else) queues instead of waiting out SYN retries.
"""

from __future__ import annotations

import errno
import socket
import threading
from http.server import ThreadingHTTPServer

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.exposition import MetricsHandler


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = socket.SOMAXCONN


class _Handler(MetricsHandler):
    """prometheus_client's handler, plus HEAD (a load balancer's or uptime probe's check)."""

    def do_HEAD(self) -> None:
        body = generate_latest(self.registry)
        self.send_response(200)
        self.send_header("Content-Type", CONTENT_TYPE_LATEST)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()


class _Server6(_Server):
    address_family = socket.AF_INET6


class MetricsServer:
    """Serves `registry` at http://host:port/metrics (any path, as Prometheus' own does)."""

    def __init__(self, registry: CollectorRegistry, host: str, port: int) -> None:
        cls = _Server6 if ":" in host else _Server
        try:
            self._httpd = cls((host, port), _Handler.factory(registry))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise ValueError(f"the metrics port {port} on {host} is already in use") \
                    from None
            raise ValueError(f"cannot listen on {host}:{port} for the metrics: "
                             f"{exc.strerror or exc}") from None
        self._thread = threading.Thread(target=self._httpd.serve_forever,
                                        name="nanopipe-metrics-http", daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        host, port = self._httpd.server_address[:2]
        return f"http://{f'[{host}]' if ':' in host else host}:{port}/metrics"

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=2.0)
