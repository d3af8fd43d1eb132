"""The worker process: one tensor-parallel rank serving StepPlans.

Start-up: join the torch.distributed group, build the ModelRunner (weights, KV pool, CUDA
graphs), then report Ready (with the number of KV blocks) or StartupFailed to the launcher.
Serving: receive a StepPlan, execute it, and on rank 0 send the StepResult to the scheduler
(with lookahead, a plan that is already waiting is launched before the previous step is
finished).
It stops on Shutdown, SIGTERM/SIGINT, or when its parent dies.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import zmq

from gpu_workers.config import WorkerConfig
from gpu_workers.host_tier import HostTier, pin_by_registering
from gpu_workers.kv_transfer import KVLink
from gpu_workers.rendezvous import tcp_rendezvous
from gpu_workers.serving_compiles import ServingCompiles
from protocol import Endpoints, ProtocolError, Shutdown, StepPlan
from protocol.actor_start import from_plain, read_start
from protocol.checkpoint_match import check_checkpoint_matches
from protocol.kv_handoff import KVCancel, KVExport, KVLinks
from protocol.model_shape import ModelShape
from protocol.process_runtime import (
    POLL_MS,
    ExplainedStartupError,
    ProcessRuntime,
    Started,
    actor_process,
    start_and_serve,
)
from protocol.profile_settings import NO_TIMELINE, Timeline, host_timeline, profile_dir
from protocol.sockets import MessageSocket
from protocol.startup_phases import PhaseClock, StartupPhase

log = logging.getLogger("nanopipe.worker")
LOOKAHEAD_POLL_S = 20e-6
SPIN_S = 5e-3
"""How long a worker with a step in flight polls without sleeping: about a decode step. With
nothing in flight it blocks in poll (scheduler_proc.plans_in_flight: the depth rule)."""
IDLE_S = 0.05
"""No plan for this long and the worker is idle: it pins its host tier a slice at a time
(gpu_workers.host_tier), checking for a plan between slices every PIN_POLL_MS."""
PIN_POLL_MS = 1
DEFAULT_RENDEZVOUS_TIMEOUT_S = 300.0


def init_distributed(config: WorkerConfig, rank: int, world_size: int,
                     rendezvous_timeout_s: float = DEFAULT_RENDEZVOUS_TIMEOUT_S) -> None:
    if config.device == "cuda":
        torch.cuda.set_device(rank % max(1, torch.cuda.device_count()))
    if world_size == 1:
        return
    if not config.dist_init_method:
        raise ValueError("dist_init_method is required with more than one rank")
    backend = "nccl" if config.device == "cuda" else "gloo"
    if config.dist_init_method.startswith("tcp://"):
        store = tcp_rendezvous(config.dist_init_method, rank, world_size, rendezvous_timeout_s)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size)
        return
    dist.init_process_group(backend, init_method=config.dist_init_method, rank=rank,
                            world_size=world_size)


def check_checkpoints(config: WorkerConfig) -> None:
    """The launcher checked the checkpoints against their config.json on its host; a rank
    on another host reads its own copy, checked here (the headers only) before a model the
    checkpoint cannot fill is allocated."""
    for model in filter(None, (config.model, config.draft_model)):
        try:
            check_checkpoint_matches(model, ModelShape.from_dir(model, config.dtype))
        except ValueError as exc:
            raise ExplainedStartupError(f"model {model!r}: {exc}") from None


def served_by(runner: Any, environ: Mapping[str, str] = os.environ) -> Any:
    """What the worker serves with: the runner itself, or, when NANOPIPE_PROFILE_DIR asks for
    it, the runner inside the profiling window (gpu_workers.profiling is imported only then)."""
    if profile_dir(environ) is None:
        return runner
    from gpu_workers.profiling.step_profiler import profiled

    return profiled(runner, environ)


def since_process_start() -> float | None:
    """Seconds since this process started (Linux's /proc; None elsewhere): its interpreter
    and imports, for the ready line's `[processes: ...]`."""
    try:
        stat = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        return time.clock_gettime(time.CLOCK_BOOTTIME) - int(stat[19]) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, AttributeError):
        return None


def run_worker(config: WorkerConfig, rank: int, world_size: int, endpoints: Endpoints,
               rendezvous_timeout_s: float = DEFAULT_RENDEZVOUS_TIMEOUT_S,
               links: KVLinks | None = None, imports_s: float | None = None) -> None:
    """Process entry point for one rank. `imports_s`: how long the process took to get here."""
    clock = PhaseClock()  # on CUDA, the parts of `processes` (the ready line)
    if imports_s is not None:
        clock.parts.append(StartupPhase("processes.imports", imports_s))
    if config.device == "cuda":
        pin_by_registering()  # before anything is pinned (gpu_workers.host_tier)
    with actor_process("worker", endpoints, rank) as rt:
        def start() -> Started:
            from gpu_workers.model_runner import ModelRunner

            steps = rt.socket(zmq.PULL, endpoints.worker_steps[rank],
                              bind=not endpoints.scheduler_binds_steps,
                              accepts=(StepPlan, Shutdown, KVExport, KVCancel),
                              security=endpoints.keys)
            results = None
            if rank == 0:
                results = rt.socket(zmq.PUSH, endpoints.step_results, bind=False,
                                    security=endpoints.keys)
            check_checkpoints(config)
            clock.part("processes.setup")  # the spec, the runner's imports, sockets, checks
            init_distributed(config, rank, world_size, rendezvous_timeout_s)
            clock.part("processes.cuda")  # the CUDA context, the process group
            progress = None
            if rank == 0:
                def progress(text: str) -> None:
                    rt.report_progress(endpoints.control, text, security=endpoints.keys)
            runner = ModelRunner(config, rank, world_size, progress=progress)
            info = (f"device={runner.device} backend={runner.backend} "
                    f"dtype={runner.model_config.dtype} kv_blocks={runner.num_kv_blocks}")
            served = served_by(runner)  # itself unless NANOPIPE_PROFILE_DIR is set
            timeline = host_timeline("worker", rank)  # NANOPIPE_HOST_TIMELINE
            kv = KVLink.make(rt, links, rank, runner.kv_cache, endpoints)
            if config.device == "cuda":  # from here on a kernel variant Triton meets stalls
                ServingCompiles(rank).watch()  # a step: each is logged

            def serve() -> None:
                try:
                    _serve(served, steps, results, rt, config.lookahead, timeline, kv,
                           runner.host_tier)
                finally:
                    timeline.write()
                    if kv is not None:
                        kv.close()

            return Started(serve, info, num_kv_blocks=runner.num_kv_blocks,
                           num_host_slots=runner.num_host_slots,
                           host_block_bytes=runner.host_tier.block_bytes
                           if runner.num_host_slots else 0,
                           phases=[*runner.startup.phases, *runner.startup.parts,
                                   *(clock.parts if config.device == "cuda" else [])])

        try:
            start_and_serve(rt, endpoints, start)
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()


def _serve(runner, steps: MessageSocket, results: MessageSocket | None,
           rt: ProcessRuntime, lookahead: bool = False,
           timeline: Timeline = NO_TIMELINE, kv: KVLink | None = None,
           host_tier: HostTier | None = None) -> None:
    """Execute plans in order. With lookahead a step stays in flight while the next plan is
    awaited: if that plan arrives before the step's tokens reach the host, it is launched
    first, so the device goes from one step to the next without waiting for the host. (A
    speculating plan that reads the host's token history settles the step in flight first,
    and a verification step comes back settled: ModelRunner._launch.)

    One request's contents never end this loop: the sequence table refuses a sequence it
    cannot run and the StepResult reports it (gpu_workers.sequence_table). What still
    raises here is not one request's doing (a desync, a device failure) and ends the worker,
    so the launcher declares the engine dead and every client gets an error instead of waiting.

    A step in flight is finished as soon as the next one is queued on the device, inside
    that one's launch (ModelRunner.launch's `meanwhile`).

    `timeline` stamps each plan's arrival, the moment its step is queued on the device, the
    start of the wait for its tokens and the result's departure
    (protocol.profiling.host_timeline)..

    `kv` (prefill/decode disaggregation): exports and cancels come in plan order; transfers
    are pumped between steps and while idle (gpu_workers.kv_transfer).

    `host_tier`: pinned a slice at a time once no plan has come for IDLE_S, so a plan that
    arrives meanwhile waits for one slice at most."""
    in_flight = None
    last_plan = time.monotonic()

    def send(result) -> None:
        timeline.mark(result.step_id, "result_out")  # encoding is the hop's
        results.send(result)

    def finish(pending) -> None:
        timeline.mark(pending.step_id, "finish")
        runner.finish(pending, None if results is None else send)

    while rt.stop_reason is None:
        if kv is not None:
            kv.pump()
        if in_flight is None:
            pinning = host_tier is not None and host_tier.pinning
            wait_ms = PIN_POLL_MS if pinning else POLL_MS
            if not (steps.poll(wait_ms) if kv is None else kv.wait(steps, wait_ms)):
                if pinning and time.monotonic() - last_plan > IDLE_S:
                    host_tier.pin_idle()
                continue
        elif not _plan_before_tokens(steps, in_flight):
            finish(in_flight)
            in_flight = None
            continue
        try:
            msg = steps.recv()
        except ProtocolError as exc:  # no frame may crash a worker: log it, drop it
            log.warning("worker: dropped a bad step frame: %s", exc)
            continue
        if isinstance(msg, Shutdown):
            return
        if kv is not None and kv.handle(msg):
            continue
        timeline.mark(msg.step_id, "plan_in")
        last_plan = time.monotonic()
        previous, in_flight = in_flight, None

        def meanwhile(step_id: int = msg.step_id, previous=previous) -> None:
            # The new step is queued on the device: the previous one's result goes out now,
            # before the new step's host bookkeeping.
            timeline.mark(step_id, "launched")
            if previous is not None:
                finish(previous)

        launched = runner.launch(msg, meanwhile)
        if lookahead:
            in_flight = launched
        else:
            finish(launched)


def _plan_before_tokens(steps: MessageSocket, in_flight) -> bool:
    """Wait until the next plan arrives (True) or the step in flight is done (False).

    Both sit on the chain that paces small-batch decoding (result to the scheduler, the plan
    after next back, its launch), so the first SPIN_S are spent polling without sleeping: a
    sleep of a few µs lasts ~70 µs on Linux (timer slack), on every step, twice."""
    spin_until = time.perf_counter() + SPIN_S
    while True:
        if steps.poll(0):
            return True
        if in_flight.done():
            return steps.poll(0)
        if time.perf_counter() > spin_until:
            time.sleep(LOOKAHEAD_POLL_S)


def main() -> None:
    """`python -m gpu_workers.worker_proc`, started by the launcher (spec on stdin)."""
    imports_s = since_process_start()
    start = read_start()
    links = start.config.get("kv_links")
    run_worker(from_plain(WorkerConfig, start.config["worker"]), start.rank,
               start.config["world_size"], from_plain(Endpoints, start.config["endpoints"]),
               float(start.config.get("rendezvous_timeout_s", DEFAULT_RENDEZVOUS_TIMEOUT_S)),
               None if links is None else from_plain(KVLinks, links), imports_s)


if __name__ == "__main__":
    main()
