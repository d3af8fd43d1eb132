"""Starts, watches and stops every process of one pipeline: its lifecycle.

How a child is started lives in startup.py, how it is watched in children.py.

Start-up order: workers first (they measure how many KV blocks fit and say so in their
READY), then the scheduler (sized from that), then the detokenizer and the tokenizer, then
an attached stdout printer if asked for, and the stats-line logger (a thread of this process).
Every child dies with its launcher, and the launcher stops the pipeline when the interpreter
exits, whether or not the user closed it.
While serving, a watcher notices any child that exits and tells the survivors the engine is
dead, so requests fail instead of hanging. A stop terminates every child and removes the
run directory with its socket files.
"""

from __future__ import annotations

import atexit
import subprocess
import threading
import time
from collections.abc import Callable
from typing import Any

import zmq

from frontend.engine.children import Child, wait_for_any_exit
from frontend.engine.config import EngineConfig
from frontend.engine.startup import StartupError, await_ready, spawn
from frontend.engine.stats_log import StatsLogger
from protocol import Endpoints, EngineDead, Ready, StartupFailed
from protocol.actor_start import to_plain
from protocol.control import StartupProgress
from protocol.sockets import MessageSocket


class Pipeline:
    """One running pipeline. Use as a context manager, or call start() and stop()."""

    def __init__(self, config: EngineConfig,
                 on_progress: Callable[[str], None] | None = None) -> None:
        self.config = config
        self.endpoints: Endpoints | None = None
        self.num_kv_blocks = 0
        self._dead_reason: str | None = None
        self._children: list[Child] = []
        self._ctx: zmq.Context | None = None
        self._control: MessageSocket | None = None
        self._stopping = threading.Event()
        self._watcher: threading.Thread | None = None
        self._stats_logger: StatsLogger | None = None
        self._on_progress = on_progress
        self._stop_lock = threading.Lock()

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
        from frontend.engine.preflight import check_config

        try:
            check_config(self.config)
        except ValueError as exc:
            raise StartupError(str(exc)) from None
        # Registered before any child exists: the interpreter's exit stops the pipeline.
        atexit.register(self.stop)
        try:
            self._start()
        except BaseException:
            self.stop()
            raise

    def _progress(self, text: str) -> None:
        if self._on_progress is not None:
            self._on_progress(text)

    def _start(self) -> None:
        cfg = self.config
        tp = cfg.tensor_parallel_size
        if cfg.transport == "ipc":
            self.endpoints = Endpoints.ipc(tp)
        else:
            self.endpoints = Endpoints.tcp(tp, host=cfg.host, port=cfg.port)
        ep = self.endpoints
        self._ctx = zmq.Context()
        self._control = MessageSocket(
            self._ctx, zmq.PULL, ep.control, bind=True,
            accepts=(Ready, StartupFailed, StartupProgress), security=ep.keys)
        deadline = time.monotonic() + cfg.startup_timeout_s

        self._progress(f"starting {tp} worker{'s' if tp > 1 else ''} "
                       f"({cfg.model_name} on {cfg.resolved_device})")
        worker_cfg = to_plain(cfg.worker_config(ep.dist_init_method))
        for rank in range(tp):
            self._spawn("worker", rank, "gpu_workers.worker_proc",
                        {"worker": worker_cfg, "world_size": tp})
        readies = self._await_ready({("worker", r) for r in range(tp)}, deadline)
        self.num_kv_blocks = min(r.num_kv_blocks for r in readies)
        sched_cfg = cfg.scheduler_config(self.num_kv_blocks)
        try:
            sched_cfg.check_pool_fits_model_len()
        except ValueError as exc:
            raise StartupError(str(exc)) from None

        self._progress(f"KV cache: {self.num_kv_blocks} blocks of {sched_cfg.block_size} tokens;"
                       " starting the scheduler, tokenizer and detokenizer")
        self._spawn("scheduler", 0, "scheduler_proc.scheduler_loop",
                    {"scheduler": to_plain(sched_cfg), "world_size": tp})
        self._spawn("detokenizer", 0, "frontend.actors.detokenizer",
                    {"detokenizer": to_plain(cfg.detokenizer_config())})
        self._spawn("tokenizer", 0, "frontend.actors.tokenizer",
                    {"tokenizer": to_plain(cfg.tokenizer_config())})
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
                                             cfg.log_stats_interval)

    def _spawn(self, role: str, rank: int, module: str, config: dict[str, Any],
               argv: list[str] | None = None) -> None:
        assert self.endpoints is not None
        spawn(self._children, role, rank, module, config, self.endpoints, argv)

    def _await_ready(self, expected: set[tuple[str, int]], deadline: float) -> list[Ready]:
        assert self._control is not None
        return await_ready(self._control, self._children, expected, deadline, self._progress)

    # ------------------------------------------------------------ serving

    @property
    def dead_reason(self) -> str | None:
        """Why the engine died, or None while every process serves.

        Read synchronously as well as by the watcher: a caller that saw a process vanish
        (a client's connection dropped) gets the reason even before the watcher wakes.
        """
        if self._dead_reason is None and not self._stopping.is_set():
            for child in self._children:
                if child.proc.poll() is not None:
                    self._dead_reason = child.exit_description()
                    break
        return self._dead_reason

    def _watch(self) -> None:
        """Wait for any child to exit; then tell the survivors that the engine is dead."""
        while not self._stopping.is_set():
            exited = wait_for_any_exit([c.proc for c in self._children], timeout=0.5)
            if exited is None or self._stopping.is_set():
                continue
            reason = self.dead_reason or "a process exited"
            self._announce_death(reason)
            return

    def _announce_death(self, reason: str) -> None:
        assert self.endpoints is not None and self._ctx is not None
        ep = self.endpoints
        msg = EngineDead(reason)
        for address in (ep.scheduler_in, ep.detok_in, ep.tokenizer_ctl):
            sock = MessageSocket(self._ctx, zmq.PUSH, address, bind=False, security=ep.keys)
            try:
                sock.send(msg, zmq.NOBLOCK)
            except zmq.ZMQError:
                pass  # that peer is the one that died
            finally:
                # Linger so the message is delivered before the socket goes; a dead peer
                # costs at most the linger time.
                sock.socket.close(linger=2000)

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
        # Everything that feeds the workers stops first; then the workers, which finish the
        # plans already sent, so no rank leaves a collective that another rank is inside.
        deadline = time.monotonic() + grace_s
        feeders = [c for c in self._children if c.role != "worker"]
        workers = [c for c in self._children if c.role == "worker"]
        for group in (feeders, workers):
            for child in reversed(group):
                if child.proc.poll() is None:
                    try:
                        child.proc.terminate()
                    except ProcessLookupError:
                        pass
            for child in group:
                try:
                    child.proc.wait(max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    child.proc.kill()
                    child.proc.wait()
        self._children.clear()
        if self._watcher is not None and self._watcher is not threading.current_thread():
            self._watcher.join()
            self._watcher = None
        if self._control is not None:
            self._control.close()
            self._control = None
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None
        if self.endpoints is not None:
            self.endpoints.cleanup()

