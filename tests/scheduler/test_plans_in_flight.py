"""The pacing meter: the host's chain against the device's step, from results alone."""

from __future__ import annotations

from scheduler_proc.plans_in_flight import PacingMeter


def feed(meter: PacingMeter, first: int, n: int, *, period_s: float, busy_s: float,
         depth: int = 1, start_s: float = 0.0, decode_only: bool = True) -> float:
    """Plan and answer steps first..first+n-1, one every period_s; returns the last time."""
    now = start_s
    for step in range(first, first + n):
        meter.planned(step, depth, decode_only)
        now += period_s
        meter.result(step, busy_s, now)
    return now


def test_a_chain_longer_than_the_device_step_is_host_paced():
    meter = PacingMeter(window=8, margin=1.15)
    feed(meter, 0, 7, period_s=1e-3, busy_s=0.5e-3)
    assert not meter.host_paced()  # not a full window of periods yet
    feed(meter, 7, 2, period_s=1e-3, busy_s=0.5e-3, start_s=7e-3)
    assert meter.host_paced()
    assert abs(meter.chain_s - 1e-3) < 1e-9


def test_a_device_step_as_long_as_the_period_is_device_paced():
    meter = PacingMeter(window=8, margin=1.15)
    feed(meter, 0, 20, period_s=1e-3, busy_s=0.95e-3)
    assert not meter.host_paced()


def test_steps_two_ahead_keep_the_last_chain_until_the_device_step_outgrows_it():
    """Two ahead the period is the device's step: it does not replace the chain measured one
    ahead, but the device's busy time does count, and once it nears the chain the meter says
    device-paced (and one-ahead periods come in again)."""
    meter = PacingMeter(window=8, margin=1.15)
    now = feed(meter, 0, 9, period_s=1e-3, busy_s=0.5e-3)  # the first has no period
    now = feed(meter, 9, 29, period_s=0.5e-3, busy_s=0.5e-3, depth=2, start_s=now)
    assert meter.host_paced() and abs(meter.chain_s - 1e-3) < 1e-9
    # Two results that came in together leave one plan in flight for the next plan: its
    # period is the gap between them, not the chain, and is not taken while two ahead.
    now = feed(meter, 38, 8, period_s=0.05e-3, busy_s=0.5e-3, start_s=now)
    assert meter.host_paced() and abs(meter.chain_s - 1e-3) < 1e-9
    feed(meter, 46, 8, period_s=0.95e-3, busy_s=0.95e-3, depth=2, start_s=now)
    assert not meter.host_paced()


def test_prefill_steps_gaps_and_the_first_plan_after_idle_are_not_chain_samples():
    meter = PacingMeter(window=4, margin=1.15)
    feed(meter, 0, 4, period_s=5e-3, busy_s=0.5e-3, decode_only=False)  # prefill steps
    feed(meter, 4, 4, period_s=5e-3, busy_s=0.5e-3, depth=0)  # planned with none in flight
    assert meter.chain_s is None
    now = 0.0
    for step in range(10, 20, 2):  # results that do not follow each other
        meter.planned(step, 1, True)
        now += 5e-3
        meter.result(step, 0.5e-3, now)
    assert meter.chain_s is None and not meter.host_paced()
