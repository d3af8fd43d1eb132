"""The launcher's logging: --log-level sets what nanopipe's own loggers say.

Other libraries stay at warnings, as they would without a launcher: with the root logger at
INFO, torch printed its fake-tensor cache statistics at every exit.
"""

from __future__ import annotations

import logging

PROJECT_LOGGER = "nanopipe"
"""The parent of every logger of the project (nanopipe.launcher, nanopipe.scheduler, ...)."""
FORMAT = "%(levelname)s %(name)s: %(message)s"


def configure_logging(level: str) -> None:
    """Log warnings of any library to stderr, and nanopipe's records from `level` up."""
    logging.basicConfig(level=logging.WARNING, format=FORMAT)
    logging.getLogger(PROJECT_LOGGER).setLevel(level.upper())
