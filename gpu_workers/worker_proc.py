"""The worker process: one tensor-parallel rank serving StepPlans.

Start-up: join the torch.distributed group, build the ModelRunner (weights, KV pool, CUDA
graphs), then report Ready (with the number of KV blocks) or StartupFailed to the launcher.
Serving: receive a StepPlan, execute it, and on rank 0 send the StepResult to the scheduler.
It stops on Shutdown, SIGTERM/SIGINT, or when its parent dies.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist
import zmq

from gpu_workers.config import WorkerConfig
from protocol import Endpoints, Shutdown, StepPlan
from protocol.process_runtime import POLL_MS, ProcessRuntime
from protocol.sockets import MessageSocket

log = logging.getLogger("nanopipe.worker")


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


def run_worker(config: WorkerConfig, rank: int, world_size: int, endpoints: Endpoints) -> None:
    """Process entry point for one rank."""
    rt = ProcessRuntime("worker", rank)
    try:
        try:
            from gpu_workers.model_runner import ModelRunner

            steps = rt.socket(zmq.PULL, endpoints.worker_steps[rank], bind=True,
                              accepts=(StepPlan, Shutdown))
            results = None
            if rank == 0:
                results = rt.socket(zmq.PUSH, endpoints.step_results, bind=False)
            init_distributed(config, rank, world_size)
            runner = ModelRunner(config, rank, world_size)
        except Exception as exc:
            log.exception("worker %d: start-up failed", rank)
            rt.report_failure(endpoints.control, exc)
            raise SystemExit(1) from exc
        info = (f"device={runner.device} backend={runner.backend} "
                f"dtype={runner.model_config.dtype} kv_blocks={runner.num_kv_blocks}")
        rt.report_ready(endpoints.control, info, num_kv_blocks=runner.num_kv_blocks)
        _serve(runner, steps, results, rt)
    finally:
        rt.close()
        if dist.is_initialized():
            dist.destroy_process_group()


def _serve(runner, steps: MessageSocket, results: MessageSocket | None,
           rt: ProcessRuntime) -> None:
    while rt.stop_reason is None:
        if not steps.poll(POLL_MS):
            continue
        msg = steps.recv()
        if isinstance(msg, Shutdown):
            return
        result = runner.execute(msg)
        if results is not None and result is not None:
            results.send(result)
