"""Data-parallel replicas placed by Ray (`--ray-address`): each replica's scheduler and
tensor-parallel workers run as the usual `python -m` actor programs, each one started and
watched by a small Ray actor (`ActorHost`) that Ray schedules into the replica's placement
group, so Ray chooses the host and reserves a TP group's CPUs or GPUs on one node.

Ray only places and watches: requests, plans and results still travel over ZeroMQ, on the
addresses Ray reports for each node (the interface Ray itself uses), guarded by the run's
CURVE keys; the start-up spec still reaches each program as one msgpack message on its stdin.
The keys and specs reach the hosts through Ray's own calls, so they are as private as the
Ray cluster is. The tokenizer and detokenizer stay with the launcher.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import subprocess
import sys
import uuid
from typing import Any

from frontend.engine.children import Child
from frontend.engine.config import EngineConfig
from frontend.engine.startup import _PACKAGE_ROOT, StartupError, child_env
from protocol import Endpoints
from protocol.actor_start import ActorStart, encode_start, to_plain
from protocol.auth import CREDENTIALS_FILE, write_credentials

REPLICA_OWN_PORTS = 4
"""scheduler_in, step_results, deltas_pub and the rendezvous, besides one per rank."""


class ActorHost:
    """Runs one actor program on the node Ray chose, and reports its exit."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen | None = None

    def node_ip(self) -> str:
        import ray

        return ray.util.get_node_ip_address()

    def free_ports(self, host: str, count: int) -> list[int]:
        held = []
        try:
            for _ in range(count):
                s = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
                s.bind((host, 0))
                held.append(s)
            return [s.getsockname()[1] for s in held]
        finally:
            for s in held:
                s.close()

    def start(self, module: str, role: str, rank: int, config: dict[str, Any]) -> int:
        env = child_env()
        self.proc = subprocess.Popen([sys.executable, "-m", module], stdin=subprocess.PIPE,
                                     env=env, start_new_session=True, close_fds=True)
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(encode_start(ActorStart(role, rank, os.getpid(), config)))
            self.proc.stdin.close()
        except BrokenPipeError:
            pass  # it died at once: wait() reports it
        return self.proc.pid

    def wait(self) -> int:
        assert self.proc is not None
        return self.proc.wait()

    def terminate(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()


class RayProc:
    """The launcher's view of a program an ActorHost runs: the parts of Popen it uses."""

    def __init__(self, host: Any, pid: int) -> None:
        self.host = host
        self.pid = pid
        self.returncode: int | None = None
        self._exit = host.wait.remote()

    def _finish(self) -> int:
        import ray

        try:
            self.returncode = ray.get(self._exit)
        except ray.exceptions.RayError:  # the host itself is gone, and its child with it
            self.returncode = -9
        return self.returncode

    def poll(self) -> int | None:
        import ray

        if self.returncode is None and ray.wait([self._exit], timeout=0)[0]:
            self._finish()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        import ray

        if self.returncode is None:
            if not ray.wait([self._exit], timeout=timeout)[0]:
                raise subprocess.TimeoutExpired(f"ray actor pid {self.pid}", timeout or 0)
            self._finish()
        assert self.returncode is not None
        return self.returncode

    def terminate(self) -> None:
        self.host.terminate.remote()

    def kill(self) -> None:
        import ray

        ray.kill(self.host)


class RayPlacement:
    """The replicas' placement groups and hosts on a Ray cluster, and their endpoints."""

    def __init__(self, cfg: EngineConfig) -> None:
        import ray

        self._owns_ray = not ray.is_initialized()
        if self._owns_ray:
            ray.init(address=cfg.ray_address, namespace="nanopipe", log_to_driver=False,
                     runtime_env={"env_vars": {"PYTHONPATH": _PACKAGE_ROOT}})
        self._host_cls = ray.remote(max_concurrency=4)(ActorHost)
        self.groups: list[Any] = []
        self.hosts: list[list[Any]] = []
        self.cfg = cfg
        driver_ip = ray.util.get_node_ip_address()
        tp = cfg.tensor_parallel_size
        base = Endpoints.tcp(tp, host=cfg.host, port=cfg.port, internal_host=driver_ip)
        try:
            self.replicas = [self._place(i, base, cfg.startup_timeout_s)
                             for i in range(cfg.data_parallel_size)]
        except BaseException:
            self.close()
            base.cleanup()
            raise
        # Replica 0 is the pipeline's own endpoints, as on one host.
        self.endpoints = dataclasses.replace(self.replicas[0], run_dir=base.run_dir)
        assert base.run_dir is not None and base.keys is not None
        os.remove(os.path.join(base.run_dir, CREDENTIALS_FILE))
        write_credentials(base.run_dir, self.endpoints.deltas_pub, base.keys)

    def _place(self, index: int, base: Endpoints, timeout_s: float) -> Endpoints:
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        tp, gpus = self.cfg.tensor_parallel_size, self.cfg.resolved_device == "cuda"
        rank_bundle = {"CPU": 1, "GPU": 1} if gpus else {"CPU": 1}
        bundles = [dict(rank_bundle) for _ in range(tp)] + [{"CPU": 1}]  # + the scheduler
        group = placement_group(bundles, strategy="STRICT_PACK",
                                name=f"nanopipe-{uuid.uuid4().hex[:8]}-replica-{index}")
        self.groups.append(group)
        try:
            ray.get(group.ready(), timeout=timeout_s)
        except ray.exceptions.GetTimeoutError:
            raise StartupError(f"Ray could not place replica {index} within {timeout_s:g}s: it "
                               f"needs one node with {bundles} free") from None
        hosts = [self._host_cls.options(
            num_cpus=bundle["CPU"], num_gpus=bundle.get("GPU", 0),
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                group, placement_group_bundle_index=b)).remote()
            for b, bundle in enumerate(bundles)]
        self.hosts.append(hosts)
        ip = ray.get(hosts[-1].node_ip.remote())
        ports = ray.get(hosts[-1].free_ports.remote(ip, REPLICA_OWN_PORTS + tp))
        at = f"tcp://[{ip}]:" if ":" in ip else f"tcp://{ip}:"
        control = base.control if index == 0 else base.replica(index).control
        return dataclasses.replace(
            base, scheduler_in=f"{at}{ports[0]}", step_results=f"{at}{ports[1]}",
            deltas_pub=f"{at}{ports[2]}", dist_init_method=f"{at}{ports[3]}",
            worker_steps=tuple(f"{at}{p}" for p in ports[REPLICA_OWN_PORTS:]),
            control=control, run_dir=None)  # the run directory is the launcher's alone

    def spawn(self, children: list[Child], role: str, rank: int, module: str,
              config: dict[str, Any], endpoints: Endpoints, replica: int,
              name_replica: int | None) -> None:
        """Start `python -m module` on the host of `role` `rank` in `replica`'s group."""
        import ray

        host = self.hosts[replica][rank if role == "worker" else -1]
        start = {**config, "endpoints": to_plain(endpoints)}
        pid = ray.get(host.start.remote(module, role, rank, start))
        children.append(Child(role, rank, module, RayProc(host, pid), name_replica))

    def close(self) -> None:
        import ray
        from ray.util.placement_group import remove_placement_group

        for hosts in self.hosts:
            for host in hosts:
                ray.kill(host)
        for group in self.groups:
            remove_placement_group(group)
        self.hosts, self.groups = [], []
        if self._owns_ray:
            ray.shutdown()
