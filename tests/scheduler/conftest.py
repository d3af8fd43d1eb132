"""Fixtures shared by the scheduler's tests."""

from __future__ import annotations

import pytest
import zmq

from protocol import Endpoints


@pytest.fixture
def wiring():
    """A context and a fresh deltas_pub address for a DeltasPublisher and its watchers."""
    endpoints = Endpoints.ipc(1)
    ctx = zmq.Context()
    yield ctx, endpoints.deltas_pub
    ctx.destroy(linger=0)
    endpoints.cleanup()
