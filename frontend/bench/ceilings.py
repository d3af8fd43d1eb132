"""The two ceilings of the hardware bound (frontend.bench.common.hardware): the device's copy
bandwidth and its bf16 matmul rate, measured once per benchmark run.

A speed is reported as a ratio to the hardware limit measured in the same run: fixed figures
of one device make every ratio taken on another device wrong (an H100 copies ~3.0 TB/s, an
H200 ~4.3). The measurement runs in a short-lived child process
(frontend.bench.ceilings_probe), so the benchmark's own process never holds a CUDA context
or memory that the engine under test would miss; its result is kept for the rest of the
run. Without a CUDA device the fixed H200 figures stand in, marked nominal (measured=False).

No torch here: the record and the report read these without it.
"""

from __future__ import annotations

import functools
import json
import subprocess
import sys
from dataclasses import dataclass


@dataclass(frozen=True)
class DeviceCeilings:
    """What one device can do at most, as the bound spends it."""

    copy_bytes_per_s: float
    """A device-to-device copy's bytes per second, reads and writes both counted: the DRAM
    traffic a copy sustains, so the rate at which a kernel that only reads can read. The
    bound divides the bytes a workload reads by it, so a purely read-bound kernel can reach
    a ratio of ~1 (the old fixed "device copy ~4.3 TB/s" of an H200 counted the same way)."""
    matmul_flops_per_s: float
    """bf16 FLOPs per second of a large square matrix product (2·n³ FLOPs)."""
    device_name: str
    measured: bool
    """False for the fixed H200 figures that stand in where nothing was measured."""

    @property
    def copy_tb_s(self) -> float:
        return self.copy_bytes_per_s / 1e12

    @property
    def matmul_tflop_s(self) -> float:
        return self.matmul_flops_per_s / 1e12

    def describe(self) -> str:
        """One line that says which ceilings a ratio used, and whether they were measured."""
        figures = f"copy {self.copy_tb_s:.3g} TB/s, bf16 matmul {self.matmul_tflop_s:.0f} TFLOP/s"
        if self.measured:
            return f"{figures}, measured on {self.device_name}"
        return f"{figures}, nominal {self.device_name} figures (not measured)"

    def record(self) -> dict:
        """The ceilings as a record keeps them (frontend.bench.record)."""
        return {"copy_tb_s": round(self.copy_tb_s, 4),
                "matmul_tflop_s": round(self.matmul_tflop_s, 1),
                "measured": self.measured, "device": self.device_name}

    @classmethod
    def from_record(cls, raw: object) -> DeviceCeilings | None:
        """The ceilings a record (or the probe's output line) holds; None for anything else
        (a record from before the ceilings were recorded, a hand edit)."""
        if not isinstance(raw, dict):
            return None
        copy, matmul = raw.get("copy_tb_s"), raw.get("matmul_tflop_s")
        if not all(isinstance(x, (int, float)) and not isinstance(x, bool) and x > 0
                   for x in (copy, matmul)):
            return None
        return cls(copy * 1e12, matmul * 1e12, str(raw.get("device") or ""),
                   raw.get("measured") is True)


NOMINAL = DeviceCeilings(4.3e12, 790e12, "H200", measured=False)
"""An H200's copy bandwidth and bf16 matmul rate, measured once: the fallback where there is
no CUDA device to measure."""

PROBE_TIMEOUT_S = 300


def measure_in_child(timeout_s: float = PROBE_TIMEOUT_S) -> DeviceCeilings:
    """The ceilings of this process's first CUDA device, from a child process that measures
    them and exits (its context and buffers go with it); NOMINAL, saying why, where the
    child fails or finds no CUDA device."""
    command = [sys.executable, "-m", "frontend.bench.ceilings_probe"]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s)
    except (OSError, subprocess.SubprocessError) as exc:
        return _nominal(f"the probe did not finish ({exc})")
    if done.returncode != 0:
        tail = (done.stderr.strip().splitlines() or ["no message"])[-1]
        return _nominal(f"the probe exited with {done.returncode}: {tail}")
    found = parse_probe_output(done.stdout)
    if found is None:
        return _nominal("the probe printed no ceilings")
    return found if found.measured else _nominal("the probe found no CUDA device")


def parse_probe_output(stdout: str) -> DeviceCeilings | None:
    """The ceilings in the probe's last output line (its JSON), or None."""
    lines = stdout.strip().splitlines()
    try:
        return DeviceCeilings.from_record(json.loads(lines[-1])) if lines else None
    except ValueError:
        return None


def _nominal(why: str) -> DeviceCeilings:
    print(f"hardware bound: device ceilings not measured, {why}; using the nominal "
          f"{NOMINAL.device_name} figures", file=sys.stderr, flush=True)
    return NOMINAL


@functools.cache
def _cuda_ceilings() -> DeviceCeilings:
    return measure_in_child()


_used: list[DeviceCeilings] = []
"""The ceilings handed out in this run (the last one is recorded with its figures)."""


def device_ceilings(device: str | None) -> DeviceCeilings:
    """The ceilings for a run on `device` ("cuda" or "cpu"): on cuda measured once per process
    (one measurement per `nanopipe bench` run), elsewhere NOMINAL. Call it before the engine
    under test starts, so the probe has the device to itself."""
    ceilings = _cuda_ceilings() if device == "cuda" else NOMINAL
    _used.append(ceilings)
    return ceilings


def used_ceilings() -> DeviceCeilings | None:
    """The ceilings this run's bounds used, or None where no bound asked for them."""
    return _used[-1] if _used else None


def forget() -> None:
    """Forget the measurement and its use: the next run measures again."""
    _cuda_ceilings.cache_clear()
    _used.clear()
