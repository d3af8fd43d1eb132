"""Starts, watches and stops every process of one pipeline: its lifecycle (how a child is
started lives in startup.py, how it is watched in children.py). With data_parallel_size N
(or prefill + decode replicas: disagg.py) there are N replicas (a scheduler and its workers
each, see Endpoints.replica) behind the one tokenizer, whose router places each request;
the death of one replica's process fails only the requests placed there and leaves the
pipeline `degraded`, serving on the others. A tensor-parallel group may span hosts
(nodes.py: node 0 runs this Pipeline, the others NodeRanks), and Ray may place the replicas
(ray_launch.py).

Start-up order: the workers (they size the KV cache and say so in their READY) with the
tokenizer and detokenizer beside them (unless a router needs the workers' pools), then the
scheduler (sized from the workers), a stdout printer if asked for, and the stats logger (a
thread). `startup` says where the time went. Every child dies with its launcher, and the
launcher stops the pipeline when the interpreter exits, whether or not the user closed it.
While serving, a watcher notices any child that exits and tells the survivors the engine is
dead, so requests fail instead of hanging. A stop terminates every child and removes the
run directory with its socket files (decode replicas' workers before the other workers:
children.stop_order)."""

from __future__ import annotations

import atexit
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import zmq

from frontend.engine.children import Child, stop_children, stop_order, tell_once, wait_for_any_exit
from frontend.engine.config import EngineConfig
from frontend.engine.disagg import replica_links, replicas_down, scheduler_role, worker_env
from frontend.engine.nodes import cluster_endpoints, missing_ranks_hint
from frontend.engine.options import ConfigError
from frontend.engine.preflight import ModelFilesCheck, check_config
from frontend.engine.ray_launch import RayPlacement
from frontend.engine.startup import (
    StartupError,
    await_ready,
    control_links,
    run_dir_removed,
    spawn,
    spawn_frontend,
)
from frontend.engine.startup_times import StartupTimes, startup_times
from frontend.engine.stats_log import StatsLogger
from protocol import Endpoints, EngineDead, Ready
from protocol.actor_start import to_plain
from protocol.control import ReplicaDown
from protocol.sockets import MessageSocket

log = logging.getLogger("nanopipe.launcher")


class Pipeline:
    """One running pipeline. Use as a context manager, or call start() and stop()."""

    def __init__(self, config: EngineConfig,
                 on_progress: Callable[[str], None] | None = None) -> None:
        self.config = config
        self.endpoints: Endpoints | None = None
        self.num_kv_blocks = self.num_host_slots = 0
        self.startup: StartupTimes | None = None  # where start-up's time went, once ready
        self._dead_reason: str | None = None
        self.replicas: list[Endpoints] = []
        self.down_replicas: dict[int, str] = {}
        """Replicas lost while the others serve on: index -> why."""
        self._replica_controls: list[MessageSocket] = []
        self._children: list[Child] = []
        self._ctx: zmq.Context | None = None
        self._control: MessageSocket | None = None
        self._stopping = threading.Event()
        self._watcher: threading.Thread | None = None
        self._stats_logger: StatsLogger | None = None
        self._on_progress = on_progress
        self._stop_lock = threading.Lock()
        self._ray: RayPlacement | None = None

    @property
    def address(self) -> str:
        """Where clients connect (the tokenizer)."""
        assert self.endpoints is not None, "the pipeline is not started"
        return self.endpoints.tokenizer

    @property
    def children(self) -> list[Child]:
        return list(self._children)

    def __enter__(self) -> Pipeline:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ------------------------------------------------------------ start-up

    def start(self) -> None:
        """Check the configuration, then start every process and wait for each READY."""
        began = time.monotonic()
        if self.config.node_rank > 0:
            raise StartupError(f"node {self.config.node_rank} runs only its worker ranks: "
                               "start it with `nanopipe serve --node-rank ...` (NodeRanks)")
        try:
            files = check_config(self.config, files_beside=True)
        except ConfigError:
            raise  # names its field, for LLM(...) callers
        except ValueError as exc:
            raise StartupError(str(exc)) from None
        # Registered before any child exists: the interpreter's exit stops the pipeline.
        atexit.register(self.stop)
        try:
            self._start(files)
        except BaseException as exc:
            removed = run_dir_removed(self.endpoints) if isinstance(exc, zmq.ZMQError) else None
            self.stop()
            if removed is not None:  # the launcher's own bind or connect found it gone
                raise removed from None
            raise
        self.startup = startup_times(began, self._children, time.monotonic())

    def _progress(self, text: str) -> None:
        if self._on_progress is not None:
            self._on_progress(text)

    def _start(self, files: ModelFilesCheck) -> None:
        cfg = self.config
        tp, dp = cfg.tensor_parallel_size, cfg.num_replicas
        worker_template = cfg.worker_config("")  # before the run directory: nothing to orphan
        if cfg.ray_address is not None:
            self._progress(f"placing {dp} replica{'s' if dp > 1 else ''} on Ray")
            self._ray = RayPlacement(cfg)
            self.endpoints, self.replicas = self._ray.endpoints, self._ray.replicas
        else:
            if cfg.nnodes > 1:
                self.endpoints = cluster_endpoints(cfg, self._progress)
            elif cfg.transport == "ipc":
                self.endpoints = Endpoints.ipc(tp)
            else:
                self.endpoints = Endpoints.tcp(tp, host=cfg.host, port=cfg.port)
            self.replicas = [self.endpoints.replica(i) for i in range(dp)]
        ep = self.endpoints
        self._ctx = zmq.Context()
        self._replica_controls = control_links(self._ctx, self.replicas, ep.keys)
        self._control = self._replica_controls[0]
        deadline = time.monotonic() + cfg.startup_timeout_s
        links = replica_links(cfg, self.replicas)
        for i, rep in enumerate(self.replicas):
            worker_cfg = to_plain(replace(worker_template, dist_init_method=rep.dist_init_method))
            for rank in cfg.local_ranks:
                self._spawn("worker", rank, "gpu_workers.worker_proc",
                            {"worker": worker_cfg, "world_size": tp, **links[i]["ranks"][rank],
                             "rendezvous_timeout_s": cfg.startup_timeout_s}, replica=i,
                            env=worker_env(cfg, i))
        files.result(StartupError)  # it ran beside the spawns: an error stops them
        self._progress(f"starting {dp * tp} worker{'s' if dp * tp > 1 else ''} "
                       f"({cfg.model_name} on {cfg.resolved_device}"
                       f"{f', {dp} replicas of tp={tp}' if dp > 1 else ''})")
        if dp == 1:  # the tokenizers load while the workers start
            spawn_frontend(self._children, ep, cfg.tokenizer_config(), cfg.detokenizer_config())
        kv_blocks, host_slots, host_bytes = [], [], []
        for i in range(dp):
            # Ranks on other hosts report on node 0's control link like the local ones.
            try:
                readies = self._await_ready({("worker", r) for r in range(tp)}, deadline, i)
            except StartupError as exc:
                if not str(exc).startswith("timed out"):
                    raise
                raise StartupError(f"{exc}{missing_ranks_hint(cfg)}") from None
            kv_blocks.append(min(r.num_kv_blocks for r in readies))
            host_slots.append(min(r.num_host_slots for r in readies))
            host_bytes.append(sum(r.host_block_bytes for r in readies))
        self.num_kv_blocks, self.num_host_slots = min(kv_blocks), min(host_slots)
        sched_cfg = cfg.scheduler_config(self.num_kv_blocks, self.num_host_slots, max(host_bytes))
        try:
            sched_cfg.check_pool_fits_model_len()
        except ValueError as exc:
            raise StartupError(str(exc)) from None

        gib = cfg.resolved_kv_offloading_size
        tier = f", host tier {self.num_host_slots} blocks ({gib:g} GiB per rank)" * bool(gib)
        self._progress(f"KV cache: {self.num_kv_blocks} blocks of {sched_cfg.block_size} tokens"
                       f" ({cfg.kv_cache_label}){tier}{' per replica' if dp > 1 else ''}; "
                       f"starting the scheduler{'s' if dp > 1 else ''}, tokenizer and detokenizer")
        for i, rep in enumerate(self.replicas):
            self._spawn("scheduler", 0, "scheduler_proc.scheduler_loop",
                        {"scheduler": to_plain(scheduler_role(cfg, sched_cfg, i)),
                         "world_size": tp, **links[i]["scheduler"]}, replica=i, endpoints=rep)
        if dp > 1:  # a router is sized from the workers' pools
            spawn_frontend(self._children, ep, cfg.tokenizer_config(cfg.router_config(
                self.replicas, kv_blocks)), cfg.detokenizer_config())
        for i in range(1, dp):  # then replica 0's and the shared processes' below
            self._await_ready({("scheduler", 0)}, deadline, i)
        self._await_ready({("scheduler", 0), ("detokenizer", 0), ("tokenizer", 0)}, deadline)
        if cfg.stdout:
            # Over tcp the run directory holds the credentials of the internal links.
            target = ep.deltas_pub if ep.keys is None else ep.run_dir
            self._spawn("stdout_detokenizer", 0, "frontend.actors.stdout_detokenizer", {},
                        argv=["--model", cfg.model_dir, "--control", ep.control, target])
            # Ready means subscribed: every request sent after "ready" is printed.
            self._await_ready({("stdout_detokenizer", 0)}, deadline)
        self._watcher = threading.Thread(target=self._watch, name="nanopipe-watch", daemon=True)
        self._watcher.start()
        if cfg.log_stats_interval > 0:
            self._stats_logger = StatsLogger(self._ctx, ep.deltas_pub, ep.keys,
                                             cfg.log_stats_interval, device=cfg.resolved_device)

    def _spawn(self, role: str, rank: int, module: str, config: dict[str, Any],
               argv: list[str] | None = None, replica: int | None = None,
               endpoints: Endpoints | None = None, env: dict[str, str] | None = None) -> None:
        assert self.endpoints is not None
        replica_index = replica
        if replica is not None:
            endpoints = endpoints or self.replicas[replica]
            if len(self.replicas) == 1:
                replica = None  # one replica: named as before, its death is the engine's
        if replica_index is not None and self._ray is not None:
            self._ray.spawn(self._children, role, rank, module, config, endpoints,
                            replica_index, replica)
            return
        spawn(self._children, role, rank, module, config, endpoints or self.endpoints, argv,
              replica, env)

    def _await_ready(self, expected: set[tuple[str, int]], deadline: float,
                     replica: int = 0) -> list[Ready]:
        control = self._replica_controls[replica]
        return await_ready(control, self._children, expected, deadline, self._progress,
                           self.endpoints, replica if len(self.replicas) > 1 else None)

    # ------------------------------------------------------------ serving

    @property
    def dead_reason(self) -> str | None:
        """Why the engine died, or None while it serves (perhaps `degraded`).

        Read synchronously as well as by the watcher: a caller that saw a process vanish
        (a client's connection dropped) gets the reason even before the watcher wakes.
        """
        if self._dead_reason is None and not self._stopping.is_set():
            for child in self._serving_children():
                if child.proc.poll() is not None and self._fatal(child):
                    self._dead_reason = child.exit_description()
                    break
        return self._dead_reason

    @property
    def degraded(self) -> str | None:
        """Why some data-parallel replicas are gone while the others serve, or None."""
        if not self.down_replicas or self.dead_reason is not None:
            return None
        return replicas_down(self.config, self.down_replicas)

    def _serving_children(self) -> list[Child]:
        return [c for c in self._children if c.replica not in self.down_replicas]

    def _fatal(self, child: Child) -> bool:
        """Whether this child's exit ends the engine: a shared process, or the last replica."""
        if child.replica is None:
            return True
        return len(self.down_replicas) + 1 >= len(self.replicas)

    def _watch(self) -> None:
        """Wait for any child to exit: a replica's process takes that replica down; any
        other (or the last replica's) ends the engine, and the survivors are told."""
        while not self._stopping.is_set():
            serving = self._serving_children()
            exited = wait_for_any_exit([c.proc for c in serving], timeout=0.5)
            if exited is None or self._stopping.is_set():
                continue
            child = next(c for c in serving if c.proc is exited)
            if not self._fatal(child):
                self._replica_down(child)
                continue
            reason = self.dead_reason or "a process exited"
            self._announce_death(reason)
            return

    def _replica_down(self, child: Child) -> None:
        """Fail the replica's requests, stop what is left of it, serve on with the others."""
        assert child.replica is not None and self.endpoints is not None
        replica, reason = child.replica, child.exit_description()
        self.down_replicas[replica] = reason
        log.error("nanopipe: %s; the other replicas serve on", reason)
        self._push(self.endpoints.tokenizer_ctl, ReplicaDown(replica, reason))
        stop_children([[c for c in self._children if c.replica == replica]], grace_s=5.0)

    def _push(self, address: str, msg: object) -> None:
        assert self.endpoints is not None and self._ctx is not None
        tell_once(self._ctx, address, msg, self.endpoints.keys)

    def _announce_death(self, reason: str) -> None:
        assert self.endpoints is not None
        ep = self.endpoints
        msg = EngineDead(reason)
        live = [r.scheduler_in for i, r in enumerate(self.replicas)
                if i not in self.down_replicas]
        for address in (*live, ep.detok_in, ep.tokenizer_ctl):
            self._push(address, msg)

    @property
    def alive(self) -> bool:
        return self.dead_reason is None and bool(self._children)

    def wait(self, timeout: float | None = None) -> bool:
        """Block until a child dies (True) or the timeout passes (False)."""
        if self._watcher is None:
            return False
        self._watcher.join(timeout)
        return not self._watcher.is_alive()

    # ------------------------------------------------------------ stop

    def stop(self, grace_s: float = 5.0) -> None:
        """Stop every child, then remove sockets and the run directory. Idempotent."""
        with self._stop_lock:
            self._stop(grace_s)

    def _stop(self, grace_s: float) -> None:
        self._stopping.set()
        atexit.unregister(self.stop)
        if self._stats_logger is not None:
            self._stats_logger.close()
            self._stats_logger = None
        stop_children(stop_order(self._children, self.config.replica_roles), grace_s)
        self._children.clear()
        if self._ray is not None:
            self._ray.close()
            self._ray = None
        if self._watcher is not None and self._watcher is not threading.current_thread():
            self._watcher.join()
            self._watcher = None
        for control in self._replica_controls[1:]:
            control.close()
        self._replica_controls = []
        if self._control is not None:
            self._control.close()
            self._control = None
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None
        if self.endpoints is not None:
            self.endpoints.cleanup()

