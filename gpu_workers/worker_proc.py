"""The worker process: one tensor-parallel rank serving StepPlans.

Start-up: join the torch.distributed group, build the ModelRunner (weights, KV pool, CUDA
graphs), then report Ready (with the number of KV blocks) or StartupFailed to the launcher.
Serving: receive a StepPlan, execute it, and on rank 0 send the StepResult to the scheduler.
It stops on Shutdown, SIGTERM/SIGINT, or when its parent dies.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
import traceback

import torch
import torch.distributed as dist
import zmq

from gpu_workers.config import WorkerConfig
from protocol import Endpoints, Ready, Shutdown, StartupFailed, StepPlan, encode
from protocol.sockets import MessageSocket

log = logging.getLogger("nanopipe.worker")

POLL_MS = 200
_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
        except OSError:
            pass


def init_distributed(config: WorkerConfig, rank: int, world_size: int) -> None:
    if config.device == "cuda":
        torch.cuda.set_device(rank % max(1, torch.cuda.device_count()))
    if world_size == 1:
        return
    if not config.dist_init_method:
        raise ValueError("dist_init_method is required with more than one rank")
    backend = "nccl" if config.device == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=config.dist_init_method, rank=rank,
                            world_size=world_size)


class _Stop:
    def __init__(self) -> None:
        self.reason: str | None = None
        self.ppid = os.getppid()
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on_signal)

    def _on_signal(self, signum, frame) -> None:
        self.reason = signal.Signals(signum).name

    def check(self) -> str | None:
        if self.reason is None and os.getppid() != self.ppid:
            self.reason = "parent process died"
        return self.reason


def run_worker(config: WorkerConfig, rank: int, world_size: int, endpoints: Endpoints) -> None:
    """Process entry point for one rank."""
    _die_with_parent()
    stop = _Stop()
    ctx = zmq.Context()
    sockets: list[MessageSocket] = []
    try:
        control = MessageSocket(ctx, zmq.PUSH, endpoints.control, bind=False)
        sockets.append(control)
        try:
            from gpu_workers.model_runner import ModelRunner

            steps = MessageSocket(ctx, zmq.PULL, endpoints.worker_steps[rank], bind=True,
                                  accepts=(StepPlan, Shutdown))
            sockets.append(steps)
            results = None
            if rank == 0:
                results = MessageSocket(ctx, zmq.PUSH, endpoints.step_results, bind=False)
                sockets.append(results)
            init_distributed(config, rank, world_size)
            runner = ModelRunner(config, rank, world_size)
        except Exception as exc:
            log.exception("worker %d: start-up failed", rank)
            error = "".join(traceback.format_exception_only(type(exc), exc)).strip()
            control.socket.send(encode(StartupFailed(role="worker", rank=rank, error=error)))
            control.socket.close(linger=2000)
            raise SystemExit(1) from exc
        info = (f"device={runner.device} backend={runner.backend} "
                f"dtype={runner.model_config.dtype} kv_blocks={runner.num_kv_blocks}")
        control.send(Ready(role="worker", rank=rank, num_kv_blocks=runner.num_kv_blocks,
                           info=info))
        _serve(runner, steps, results, stop)
    finally:
        for sock in reversed(sockets):
            sock.close()
        ctx.term()
        if dist.is_initialized():
            dist.destroy_process_group()


def _serve(runner, steps: MessageSocket, results: MessageSocket | None, stop: _Stop) -> None:
    while stop.check() is None:
        if not steps.poll(POLL_MS):
            continue
        msg = steps.recv()
        if isinstance(msg, Shutdown):
            return
        result = runner.execute(msg)
        if results is not None and result is not None:
            results.send(result)
