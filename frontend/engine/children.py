"""The pipeline's child processes as the launcher watches them: one record per actor, how
its exit reads to a user, and a wait for the first of them to exit.

Dead peers are found by their process, not by a timeout: a pidfd wakes the watcher at the
exit itself where the platform has one.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import time
from dataclasses import dataclass, field

import zmq

from protocol.auth import CurveKeys
from protocol.control import Ready
from protocol.sockets import MessageSocket


@dataclass
class Child:
    """One actor process of the pipeline."""

    role: str
    rank: int
    module: str
    proc: subprocess.Popen
    replica: int | None = None
    """The data-parallel replica it belongs to (a scheduler or worker, with more than one
    replica); None: shared by the whole pipeline, or the only replica."""
    started_at: float = field(default_factory=time.monotonic)
    ready: Ready | None = None
    """Its READY (what it learned at start-up, its start-up phases); None before."""
    ready_at: float | None = None
    """When its READY came (time.monotonic())."""

    @property
    def name(self) -> str:
        where = "" if self.replica is None else f"replica {self.replica} "
        return f"{where}{self.role} {self.rank}"

    @property
    def pid(self) -> int:
        return self.proc.pid

    def exit_description(self) -> str:
        code = self.proc.returncode
        if code is None:
            return f"{self.name} is running"
        if code < 0:
            try:
                return f"{self.name} was killed by {signal.Signals(-code).name}"
            except ValueError:
                return f"{self.name} was killed by signal {-code}"
        return f"{self.name} exited with code {code}"


def stop_order(children: list[Child], replica_roles: tuple[str, ...]) -> list[list[Child]]:
    """The children in the groups the launcher stops one after the other: what feeds the
    workers, then the workers, which finish the plans already sent (no rank leaves a
    collective another is inside). Decode replicas' workers go before the others: with
    shared KV pools they map the prefill workers' memory, and CUDA warns when the owner of
    shared memory exits while another process still holds it (disagg.py)."""
    workers = [c for c in children if c.role == "worker"]
    decode = [c for c in workers
              if c.replica is not None and replica_roles[c.replica:c.replica + 1] == ("decode",)]
    return [[c for c in children if c.role != "worker"], decode,
            [c for c in workers if c not in decode]]


def stop_children(groups: list[list[Child]], grace_s: float) -> None:
    """Terminate each group in turn (a later one once the earlier has exited), killing what
    is still running when `grace_s` has passed."""
    deadline = time.monotonic() + grace_s
    for group in groups:
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


def wait_for_any_exit(procs: list[subprocess.Popen], timeout: float) -> subprocess.Popen | None:
    """The first of `procs` found exited within `timeout` seconds, else None.

    Uses pidfds where the platform has them (woken at the exit itself), else polls.
    """
    for proc in procs:
        if proc.poll() is not None:
            return proc
    fds: dict[int, subprocess.Popen] = {}
    try:
        # A pidfd needs a local child: a Ray-hosted one (ray_launch.RayProc) is polled.
        if hasattr(os, "pidfd_open") and all(isinstance(p, subprocess.Popen) for p in procs):
            for proc in procs:
                try:
                    fds[os.pidfd_open(proc.pid)] = proc
                except OSError:
                    pass  # already reaped: poll() below finds it
        if fds and len(fds) == len(procs):
            ready, _, _ = select.select(list(fds), [], [], timeout)
            for fd in ready:
                if fds[fd].poll() is not None:
                    return fds[fd]
            return None
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            for proc in procs:
                if proc.poll() is not None:
                    return proc
            time.sleep(0.05)
        return None
    finally:
        for fd in fds:
            os.close(fd)


def tell_once(ctx: zmq.Context, address: str, msg: object, keys: CurveKeys | None) -> None:
    """Send one message to a child's socket, whether or not that child is still alive."""
    sock = MessageSocket(ctx, zmq.PUSH, address, bind=False, security=keys)
    try:
        sock.send(msg, zmq.NOBLOCK)
    except zmq.ZMQError:
        pass  # that peer is the one that died
    finally:
        # Linger so the message is delivered before the socket goes; a dead peer
        # costs at most the linger time.
        sock.socket.close(linger=2000)
