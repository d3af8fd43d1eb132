"""Where each actor of one pipeline listens, and the keys its internal links require.

Every socket of a pipeline lives in a private run directory (`ipc://`), or on loopback
TCP ports chosen free at start-up, so any number of pipelines can run side by side and
nothing listens beyond this machine unless the user asks for another host. Over TCP every
internal link requires the run's CURVE keys (protocol/auth.py); only the two sockets that
clients use accept strangers. Both transports keep a private 0700 run directory: the
torch.distributed rendezvous is a file there (never a TCP listener), and over TCP the
`credentials` file (0600) that authorised local tools read.

Endpoints is a frozen dataclass of plain fields so that it can travel to each child
process as a msgpack message.
"""

from __future__ import annotations

import os
import shutil
import socket
import tempfile
from dataclasses import dataclass, replace

from protocol.auth import CurveKeys, write_credentials

# The receiving side of each link binds; senders connect.
_NAMES = (
    "tokenizer",  # ROUTER: clients submit requests here (the pipeline's public address)
    "tokenizer_ctl",  # PULL: launcher -> tokenizer (engine dead)
    "results",  # ROUTER: clients receive their results here (the detokenizer)
    "scheduler_in",  # PULL: AddRequest / AbortRequests / EngineDead
    "step_results",  # PULL: rank 0 -> scheduler StepResults
    "detok_in",  # PULL: DetokRequestInfo from the tokenizer, TokenDeltas from the scheduler
    "deltas_pub",  # PUB: TokenDeltas for attached detokenizers (best effort)
    "control",  # PULL: Ready / StartupFailed from every process to the launcher
)


@dataclass(frozen=True)
class Endpoints:
    tokenizer: str
    tokenizer_ctl: str
    results: str
    scheduler_in: str
    step_results: str
    detok_in: str
    deltas_pub: str
    control: str
    worker_steps: tuple[str, ...]
    """PULL per tensor-parallel rank: scheduler -> worker StepPlans."""
    dist_init_method: str
    """torch.distributed rendezvous for the worker group."""
    run_dir: str | None = None
    keys: CurveKeys | None = None
    """The run's CURVE keys, required on every internal link; None over ipc://."""
    scheduler_binds_steps: bool = False
    """Who binds `worker_steps`: the workers (one host), or the scheduler, when ranks run on
    other hosts and connect to node 0, which alone listens (see `cluster`)."""

    @classmethod
    def ipc(cls, world_size: int, run_dir: str | None = None) -> Endpoints:
        """Unix-socket endpoints in a fresh private directory (removed by `cleanup`).

        No CURVE here: only this user can enter the 0700 directory, and a process of this
        user could read the keys from the pipeline's memory anyway, so keys would guard
        nothing more. (Its cost is not the reason: one ipc hop of a 256-sequence StepPlan
        measured 199-246 us with CURVE and 186-205 us without, interleaved runs of
        `nanopipe bench latency`'s hop on a loaded 2-core machine: within the noise.)"""
        run_dir = _private_run_dir(run_dir)
        addr = {name: f"ipc://{run_dir}/{name}" for name in _NAMES}
        steps = tuple(f"ipc://{run_dir}/step_r{rank}" for rank in range(world_size))
        return cls(**addr, worker_steps=steps,
                   dist_init_method=f"file://{run_dir}/dist_init", run_dir=run_dir)

    @classmethod
    def tcp(cls, world_size: int, host: str = "127.0.0.1", port: int | None = None,
            internal_host: str = "127.0.0.1", keys: CurveKeys | None = None) -> Endpoints:
        """TCP endpoints: the two that clients use (requests on host:port, a free port if
        None, and results) on `host`, the rest on loopback ports found free now and guarded
        by CURVE keys (fresh ones unless given), which are also written to the run directory
        for local tools."""
        ports = _free_ports(len(_NAMES) + world_size, internal_host)
        addr = {name: f"tcp://{internal_host}:{ports[i]}" for i, name in enumerate(_NAMES)}
        addr["tokenizer"] = f"tcp://{host}:{port or ports[0]}"
        if host != internal_host:
            addr["results"] = f"tcp://{host}:{_free_ports(1, host)[0]}"
        steps = tuple(
            f"tcp://{internal_host}:{ports[len(_NAMES) + r]}" for r in range(world_size)
        )
        run_dir = _private_run_dir(None)
        keys = keys or CurveKeys.generate()
        try:
            write_credentials(run_dir, addr["deltas_pub"], keys)
        except BaseException:
            shutil.rmtree(run_dir, ignore_errors=True)
            raise
        # A file rendezvous, as over ipc: a TCPStore would listen on every interface.
        return cls(**addr, worker_steps=steps, dist_init_method=f"file://{run_dir}/dist_init",
                   run_dir=run_dir, keys=keys)

    @classmethod
    def cluster(cls, world_size: int, master_addr: str, master_port: int, keys: CurveKeys,
                host: str = "127.0.0.1", port: int | None = None) -> Endpoints:
        """The endpoints of one tensor-parallel group spread over several hosts, as every
        host computes them from the same flags and cluster key.

        What ranks on other hosts reach listens on node 0's `master_addr` at fixed ports, so
        nothing has to be told to them: the torch.distributed rendezvous on `master_port`
        (P), the launcher's control link on P+1, the scheduler's step results on P+2 and one
        StepPlan link per rank on P+3+rank (bound by the scheduler, which every rank
        connects to). Other hosts bind nothing of ours (gloo and NCCL open their own
        sockets). The other links stay on node 0's loopback as with `tcp`."""
        ep = cls.tcp(world_size, host=host, port=port, keys=keys)
        at = f"tcp://{_bracketed(master_addr)}:"
        return replace(ep, control=f"{at}{master_port + 1}",
                       step_results=f"{at}{master_port + 2}",
                       worker_steps=tuple(f"{at}{master_port + 3 + r}"
                                          for r in range(world_size)),
                       dist_init_method=f"{at}{master_port}", scheduler_binds_steps=True)

    @staticmethod
    def cluster_ports(world_size: int, master_port: int) -> range:
        """The ports `cluster` uses on node 0's master address."""
        return range(master_port, master_port + 3 + world_size)

    def replica(self, index: int) -> Endpoints:
        """The endpoints of data-parallel replica `index`: its own scheduler input, step
        results, stats publisher, worker steps, rendezvous and control link (so its READYs
        are told apart from the other replicas'), and this run's frontend sockets, run
        directory and keys. Replica 0 is this object itself."""
        if index == 0:
            return self
        own = ("scheduler_in", "step_results", "deltas_pub", "control")
        count = len(own) + len(self.worker_steps)
        if self.keys is None:
            addr = [f"ipc://{self.run_dir}/r{index}_{name}" for name in own]
            addr += [f"ipc://{self.run_dir}/r{index}_step_r{r}"
                     for r in range(len(self.worker_steps))]
        else:
            host = self.scheduler_in.rsplit(":", 1)[0].removeprefix("tcp://")
            addr = [f"tcp://{host}:{p}" for p in _free_ports(count, host)]
        return replace(self, **dict(zip(own, addr)), worker_steps=tuple(addr[len(own):]),
                       dist_init_method=f"file://{self.run_dir}/dist_init_r{index}")

    @property
    def run_dir_missing(self) -> bool:
        """The run directory was removed under the pipeline (its sockets with it)."""
        return self.run_dir is not None and not os.path.isdir(self.run_dir)

    def cleanup(self) -> None:
        """Remove the run directory and every socket file in it."""
        if self.run_dir:
            shutil.rmtree(self.run_dir, ignore_errors=True)


def _bracketed(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def _private_run_dir(run_dir: str | None) -> str:
    run_dir = run_dir or tempfile.mkdtemp(prefix="nanopipe-", dir="/tmp")
    os.chmod(run_dir, 0o700)
    return run_dir


def _free_ports(count: int, host: str) -> list[int]:
    held = []
    try:
        for _ in range(count):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind((host, 0))
            held.append(s)
        return [s.getsockname()[1] for s in held]
    finally:
        for s in held:
            s.close()
