"""A pipeline whose tensor-parallel group spans several hosts, started by hand on each one
as torchrun does (`--nnodes N --node-rank R --master-addr A --master-port P`).

Node 0 runs the whole front (tokenizer, detokenizer, scheduler) and its share of the ranks:
the usual Pipeline, with `cluster_endpoints`. Node R > 0 runs only its ranks (`NodeRanks`):
they join the torch.distributed group at A:P and connect to node 0's scheduler and control
link over ZeroMQ tcp with CURVE keys derived from the cluster key file, which the user copies
from node 0 (created there on first use). Nothing of ours listens on node R.

Node R's launcher keeps a CURVE connection to node 0's control link with ZeroMQ heartbeats:
when node 0 goes away after having answered, it stops its ranks (they would otherwise wait
for plans forever) and exits.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable

import zmq
from zmq.utils.monitor import parse_monitor_message

from frontend.engine.children import Child, stop_children, wait_for_any_exit
from frontend.engine.config import EngineConfig
from frontend.engine.startup import StartupError, spawn
from protocol import Endpoints
from protocol.actor_start import to_plain
from protocol.auth import create_cluster_key, read_cluster_key, secure

log = logging.getLogger("nanopipe.launcher")

HEARTBEAT_MS = 1000
HEARTBEAT_TIMEOUT_MS = 5000
"""Node 0 unheard for this long (a host that vanished without closing) counts as gone."""


def cluster_endpoints(cfg: EngineConfig, progress: Callable[[str], None]) -> Endpoints:
    """The endpoints every host of the cluster computes alike; node 0 creates the key file."""
    assert cfg.master_addr is not None and cfg.master_port is not None
    assert cfg.cluster_key is not None
    if cfg.node_rank == 0 and create_cluster_key(cfg.cluster_key):
        progress(f"created the cluster key {cfg.cluster_key}: copy it to the other hosts")
    try:
        keys = read_cluster_key(cfg.cluster_key)
    except ValueError as exc:
        raise StartupError(f"--cluster-key: {exc}") from None
    return Endpoints.cluster(cfg.tensor_parallel_size, cfg.master_addr, cfg.master_port, keys,
                             host=cfg.host, port=cfg.port)


def missing_ranks_hint(cfg: EngineConfig) -> str:
    """What node 0 adds when its ranks' READYs did not all come in time."""
    if cfg.nnodes == 1:
        return ""
    return (f": not every rank joined the rendezvous at {cfg.master_addr}:{cfg.master_port} "
            f"within {cfg.startup_timeout_s:g}s (ranks {cfg.local_ranks.stop}.."
            f"{cfg.tensor_parallel_size - 1} run on the other nodes: start them with "
            f"--node-rank 1 .. {cfg.nnodes - 1}, the same --master-addr and --master-port and "
            f"a copy of --cluster-key)")


class NodeRanks:
    """Node R > 0: its worker ranks, watched until one exits, node 0 goes or stop()."""

    def __init__(self, config: EngineConfig,
                 on_progress: Callable[[str], None] | None = None) -> None:
        if config.node_rank == 0:
            raise ValueError("node 0 runs the whole front: use Pipeline")
        self.config = config
        self.children: list[Child] = []
        self.endpoints: Endpoints | None = None
        self.exit_reason: str | None = None
        self._progress = on_progress or (lambda text: None)
        self._ctx: zmq.Context | None = None
        self._link: zmq.Socket | None = None
        self._monitor: zmq.Socket | None = None
        self._node0_seen = False

    def start(self) -> None:
        from frontend.engine.preflight import check_device, check_model_fits_tp

        cfg = self.config
        try:
            check_device(cfg)
            check_model_fits_tp(cfg)
        except ValueError as exc:
            raise StartupError(str(exc)) from None
        self.endpoints = cluster_endpoints(cfg, self._progress)
        self._watch_node0()
        ranks = cfg.local_ranks
        self._progress(f"starting ranks {ranks.start}..{ranks.stop - 1} of "
                       f"{cfg.tensor_parallel_size}; they join node 0 at "
                       f"{cfg.master_addr}:{cfg.master_port}")
        worker_cfg = to_plain(cfg.worker_config(self.endpoints.dist_init_method))
        for rank in ranks:
            spawn(self.children, "worker", rank, "gpu_workers.worker_proc",
                  {"worker": worker_cfg, "world_size": cfg.tensor_parallel_size,
                   "rendezvous_timeout_s": cfg.startup_timeout_s}, self.endpoints)

    def _watch_node0(self) -> None:
        """A silent CURVE client of node 0's control link whose monitor says when node 0
        answered and when it went."""
        assert self.endpoints is not None
        self._ctx = zmq.Context()
        link = self._ctx.socket(zmq.PUSH)
        link.setsockopt(zmq.LINGER, 0)
        link.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_MS)
        link.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
        secure(link, self.endpoints.keys.client_only() if self.endpoints.keys else None,
               server=False)
        self._monitor = link.get_monitor_socket(
            zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED)
        link.connect(self.endpoints.control)
        self._link = link

    def _node0_gone(self) -> bool:
        assert self._monitor is not None
        while self._monitor.poll(0):
            event = parse_monitor_message(self._monitor.recv_multipart())["event"]
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self._node0_seen = True
            elif event == zmq.EVENT_DISCONNECTED and self._node0_seen:
                return True
        return False

    def wait(self, timeout: float) -> bool:
        """True once a rank exited or node 0 went (see exit_reason), else False."""
        exited = wait_for_any_exit([c.proc for c in self.children], timeout)
        if exited is not None:
            child = next(c for c in self.children if c.proc is exited)
            when = "" if self._node0_seen else " during start-up"
            self.exit_reason = f"{child.exit_description()}{when}"
            return True
        if self._node0_gone():
            self.exit_reason = (f"node 0 at {self.config.master_addr}:"
                                f"{self.config.master_port} went away")
            return True
        return False

    def stop(self, grace_s: float = 5.0) -> None:
        stop_children([self.children], grace_s)
        self.children.clear()
        for sock in (self._monitor, self._link):
            if sock is not None:
                sock.close(linger=0)
        self._monitor = self._link = None
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None
        if self.endpoints is not None:
            self.endpoints.cleanup()


def serve_node(config: EngineConfig, progress: Callable[[str], None]) -> int:
    """`nanopipe serve --node-rank R` for R > 0: run this host's ranks until Ctrl-C, SIGTERM,
    node 0's end (0) or a rank's exit (1)."""
    node = NodeRanks(config, on_progress=progress)
    try:
        node.start()
        while not node.wait(1.0):
            pass
        gone = node.exit_reason or ""
        print(f"nanopipe: node {config.node_rank}: {gone}", file=sys.stderr, flush=True)
        return 0 if gone.endswith("went away") else 1
    except StartupError as exc:
        print(f"nanopipe: {exc}", file=sys.stderr, flush=True)
        return 1
    except KeyboardInterrupt:
        print("nanopipe: stopping", file=sys.stderr, flush=True)
        return 0
    finally:
        node.stop()
