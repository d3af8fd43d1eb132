"""Starting the pipeline's children: one `python -m <module>` per actor, its start-up spec on
stdin, then the wait for each READY.

The spec travels as one msgpack message (protocol/actor_start.py): nothing is pickled and the
user's main module is never re-imported, so a plain script, `python -`, `python -c` and a
notebook can all start a pipeline.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import zmq

from frontend.actors.detokenizer import DetokenizerConfig
from frontend.actors.tokenizer import TokenizerConfig
from frontend.engine.children import Child
from frontend.engine.spawner import popen
from protocol import Endpoints, ProtocolError, Ready, StartupFailed
from protocol.actor_start import ActorStart, encode_start, to_plain
from protocol.auth import CurveKeys
from protocol.control import StartupProgress
from protocol.sockets import MessageSocket

log = logging.getLogger("nanopipe.launcher")

_PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])
"""The folder holding nanopipe's packages: children import the same code as the launcher."""


def child_env() -> dict[str, str]:
    """This process's environment with this checkout first on PYTHONPATH, for a child
    process that must run the launcher's own nanopipe."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (_PACKAGE_ROOT, env.get("PYTHONPATH")) if p)
    return env


REPLICA_ROLES = ("worker", "scheduler")
"""The processes each data-parallel replica has of its own; the others serve them all."""


class StartupError(RuntimeError):
    """The pipeline could not start; the message says which process and why."""


def spawn(children: list[Child], role: str, rank: int, module: str, config: dict[str, Any],
          endpoints: Endpoints, argv: list[str] | None = None, replica: int | None = None,
          env_overrides: dict[str, str] | None = None) -> None:
    """Start `python -m module`; an actor gets its spec on stdin, a tool its `argv`.

    The child joins `children` before its spec is written, so a stop that interrupts the
    write still ends it."""
    start = ActorStart(role=role, rank=rank, launcher_pid=os.getpid(),
                       config={**config, "endpoints": to_plain(endpoints)})
    env = child_env()
    env.update(env_overrides or {})
    # A session of its own: a Ctrl-C in the user's terminal reaches the launcher, which
    # then stops the children in order, instead of every process at once.
    proc = popen([sys.executable, "-m", module, *(argv or [])], stdin=subprocess.PIPE, env=env,
                 start_new_session=True, close_fds=True)
    children.append(Child(role, rank, module, proc, replica))
    assert proc.stdin is not None
    if argv is not None:
        proc.stdin.close()
        return
    try:
        proc.stdin.write(encode_start(start))
        proc.stdin.close()
    except BrokenPipeError:
        pass  # it died at once; await_ready reports its exit


def spawn_frontend(children: list[Child], endpoints: Endpoints, tokenizer: TokenizerConfig,
                   detokenizer: DetokenizerConfig) -> None:
    """Start the detokenizer and the tokenizer. With several replicas the tokenizer's router
    takes the detokenizer's aborts (at tokenizer_ctl): it knows where each request runs."""
    detok_ep = endpoints if tokenizer.router is None else replace(
        endpoints, scheduler_in=endpoints.tokenizer_ctl)
    spawn(children, "detokenizer", 0, "frontend.actors.detokenizer",
          {"detokenizer": to_plain(detokenizer)}, detok_ep)
    spawn(children, "tokenizer", 0, "frontend.actors.tokenizer",
          {"tokenizer": to_plain(tokenizer)}, endpoints)


def control_links(ctx: zmq.Context, replicas: list[Endpoints],
                  keys: CurveKeys | None) -> list[MessageSocket]:
    """The launcher's control link of each replica (the first: the pipeline's own), bound:
    each replica's ranks report on their own, as their READYs look alike."""
    return [MessageSocket(ctx, zmq.PULL, r.control, bind=True,
                          accepts=(Ready, StartupFailed, StartupProgress), security=keys)
            for r in replicas]


def run_dir_removed(endpoints: Endpoints | None) -> StartupError | None:
    """The error to fail start-up with when the run directory is gone: every socket and the
    rendezvous file live there, so a child that has not yet bound or connected never will
    (and one whose report cannot reach the launcher would be waited for until the deadline)."""
    if endpoints is None or not endpoints.run_dir_missing:
        return None
    return StartupError(f"the run directory {endpoints.run_dir} was removed during start-up "
                        "(its sockets went with it); start again")


def await_ready(control: MessageSocket, children: list[Child], expected: set[tuple[str, int]],
                deadline: float, progress: Callable[[str], None],
                endpoints: Endpoints | None = None, replica: int | None = None) -> list[Ready]:
    """Each expected (role, rank)'s READY; a child's exit, its StartupFailed, the deadline or
    the loss of `endpoints`' run directory ends start-up with a StartupError that says why.
    With `replica`, what its own processes (workers, scheduler) report names it.

    Each READY is kept in its child's record, with its arrival time (startup_times.py): one
    that came while start-up waited for others (a tokenizer during the workers' wait) is
    taken from there when it is expected."""

    def name(role: str, rank: int) -> str:
        own = replica is not None and role in REPLICA_ROLES
        return f"{f'replica {replica} ' if own else ''}{role} {rank}"

    records = {child.name: child for child in children}
    readies = [records[name(*who)].ready for who in sorted(expected)
               if name(*who) in records and records[name(*who)].ready is not None]
    waiting = set(expected) - {(r.role, r.rank) for r in readies}
    while waiting:
        if (removed := run_dir_removed(endpoints)) is not None:
            raise removed
        if time.monotonic() > deadline:
            names = ", ".join(name(role, rank) for role, rank in sorted(waiting))
            raise StartupError(f"timed out waiting for {names} to start")
        for child in children:
            if child.proc.poll() is not None:
                if (removed := run_dir_removed(endpoints)) is not None:
                    raise removed
                raise StartupError(f"{child.exit_description()} during start-up")
        if not control.poll(200):
            continue
        try:
            msg = control.recv()
        except ProtocolError as exc:
            log.warning("launcher: dropped a bad control frame: %s", exc)
            continue
        if isinstance(msg, StartupFailed):
            raise StartupError(f"{name(msg.role, msg.rank)} failed to start: {msg.error}")
        if isinstance(msg, StartupProgress):
            progress(f"{name(msg.role, msg.rank)}: {msg.text}")
            continue
        child = records.get(name(msg.role, msg.rank))
        if child is not None and child.ready is None:
            child.ready, child.ready_at = msg, time.monotonic()
        if (msg.role, msg.rank) in waiting:
            waiting.discard((msg.role, msg.rank))
            readies.append(msg)
    return readies


def replica_env(device: str, tp: int, dp: int, replica: int) -> dict[str, str] | None:
    """On cuda with several replicas, replica i's workers see GPUs i*tp .. (i+1)*tp-1 only
    (of those already visible), so each replica runs on its own GPUs."""
    if dp == 1 or device != "cuda":
        return None
    from frontend.engine.torch_build import visible_gpus

    devices = visible_gpus()
    return {"CUDA_VISIBLE_DEVICES": ",".join(devices[replica * tp:(replica + 1) * tp])}
