"""Starts, watches and stops every process of one pipeline.

Start-up order: workers first (they measure how many KV blocks fit and say so in their
READY), then the scheduler (sized from that), then the detokenizer and the tokenizer.
Every child dies with its parent. While serving, a watcher notices any child that exits
and tells the survivors the engine is dead, so requests fail instead of hanging. A stop
terminates every child and removes the run directory with its socket files.
"""

from __future__ import annotations

import importlib
import logging
import multiprocessing as mp
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import wait as wait_for_sentinels
from typing import Any

import zmq

from frontend.config import EngineConfig
from protocol import Endpoints, EngineDead, ProtocolError, Ready, StartupFailed
from protocol.sockets import MessageSocket

log = logging.getLogger("nanopipe.launcher")


class StartupError(RuntimeError):
    """The pipeline could not start; the message says which process and why."""


@dataclass(frozen=True)
class ChildSpec:
    role: str
    rank: int
    module: str
    function: str
    args: tuple


def _child_entry(spec: ChildSpec) -> None:
    from protocol.process_runtime import die_with_parent

    die_with_parent()
    target = getattr(importlib.import_module(spec.module), spec.function)
    target(*spec.args)


class Pipeline:
    """One running pipeline. Use as a context manager, or call start() and stop()."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.endpoints: Endpoints | None = None
        self.num_kv_blocks = 0
        self.dead_reason: str | None = None
        self._children: list[tuple[ChildSpec, Any]] = []
        self._mp = mp.get_context("spawn")
        self._ctx: zmq.Context | None = None
        self._control: MessageSocket | None = None
        self._stopping = threading.Event()
        self._watcher: threading.Thread | None = None

    @property
    def address(self) -> str:
        """Where clients connect (the tokenizer)."""
        assert self.endpoints is not None, "the pipeline is not started"
        return self.endpoints.tokenizer

    def __enter__(self) -> Pipeline:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ------------------------------------------------------------ start-up

    def start(self) -> None:
        try:
            self._start()
        except BaseException:
            self.stop()
            raise

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
            self._ctx, zmq.PULL, ep.control, bind=True, accepts=(Ready, StartupFailed),
            security=ep.keys)
        deadline = time.monotonic() + cfg.startup_timeout_s

        worker_cfg = cfg.worker_config(ep.dist_init_method)
        for rank in range(tp):
            self._spawn(ChildSpec("worker", rank, "gpu_workers.worker_proc", "run_worker",
                                  (worker_cfg, rank, tp, ep)))
        readies = self._await_ready({("worker", r) for r in range(tp)}, deadline)
        self.num_kv_blocks = min(r.num_kv_blocks for r in readies)
        sched_cfg = cfg.scheduler_config(self.num_kv_blocks)
        try:
            sched_cfg.check_pool_fits_model_len()
        except ValueError as exc:
            raise StartupError(str(exc)) from None

        from frontend.detokenizer_proc import DetokenizerConfig
        from frontend.tokenizer_proc import TokenizerConfig

        self._spawn(ChildSpec("scheduler", 0, "scheduler_proc.scheduler_loop", "run_scheduler",
                              (sched_cfg, ep, tp)))
        self._spawn(ChildSpec("detokenizer", 0, "frontend.detokenizer_proc", "run_detokenizer",
                              (DetokenizerConfig(model=cfg.model_dir), ep)))
        tok_cfg = TokenizerConfig(model=cfg.model_dir, model_name=cfg.model_name,
                                  max_model_len=cfg.resolved_max_model_len)
        self._spawn(ChildSpec("tokenizer", 0, "frontend.tokenizer_proc", "run_tokenizer",
                              (tok_cfg, ep)))
        self._await_ready({("scheduler", 0), ("detokenizer", 0), ("tokenizer", 0)}, deadline)
        if cfg.stdout:
            self._spawn(ChildSpec("stdout", 0, "frontend.stdout_detokenizer", "run_attached",
                                  (cfg.model_dir, ep.deltas_pub)))
        self._watcher = threading.Thread(target=self._watch, name="nanopipe-watch", daemon=True)
        self._watcher.start()

    def _spawn(self, spec: ChildSpec) -> None:
        proc = self._mp.Process(target=_child_entry, args=(spec,),
                                name=f"nanopipe-{spec.role}{spec.rank}", daemon=False)
        proc.start()
        self._children.append((spec, proc))

    def _await_ready(self, expected: set[tuple[str, int]], deadline: float) -> list[Ready]:
        readies: list[Ready] = []
        waiting = set(expected)
        assert self._control is not None
        while waiting:
            if time.monotonic() > deadline:
                raise StartupError(f"timed out waiting for {sorted(waiting)} to start")
            for spec, proc in self._children:
                if proc.exitcode is not None:
                    raise StartupError(
                        f"{spec.role} {spec.rank} exited with code {proc.exitcode} during start-up"
                    )
            if not self._control.poll(200):
                continue
            try:
                msg = self._control.recv()
            except ProtocolError as exc:
                log.warning("launcher: dropped a bad control frame: %s", exc)
                continue
            if isinstance(msg, StartupFailed):
                raise StartupError(f"{msg.role} {msg.rank} failed to start: {msg.error}")
            waiting.discard((msg.role, msg.rank))
            readies.append(msg)
        return readies

    # ------------------------------------------------------------ serving

    def _watch(self) -> None:
        """Wait for any child to exit; then tell the survivors that the engine is dead."""
        sentinels = {proc.sentinel: (spec, proc) for spec, proc in self._children}
        while not self._stopping.is_set():
            ready = wait_for_sentinels(list(sentinels), timeout=0.5)
            if not ready or self._stopping.is_set():
                continue
            spec, proc = sentinels[ready[0]]
            proc.join(0)
            self.dead_reason = f"{spec.role} {spec.rank} exited with code {proc.exitcode}"
            self._announce_death(self.dead_reason)
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
        return self.dead_reason is None and all(p.is_alive() for _, p in self._children)

    def wait(self, timeout: float | None = None) -> bool:
        """Block until a child dies (True) or the timeout passes (False)."""
        if self._watcher is None:
            return False
        self._watcher.join(timeout)
        return not self._watcher.is_alive()

    # ------------------------------------------------------------ stop

    def stop(self, grace_s: float = 5.0) -> None:
        """Stop every child, then remove sockets and the run directory. Idempotent."""
        self._stopping.set()
        for _, proc in reversed(self._children):
            if proc.is_alive():
                proc.terminate()
        deadline = time.monotonic() + grace_s
        for _, proc in self._children:
            proc.join(max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                proc.kill()
                proc.join()
        self._children.clear()
        if self._watcher is not None:
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
