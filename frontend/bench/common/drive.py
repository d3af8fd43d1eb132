"""The scheduler and the model runner driven in this process, step by step (no overlap).

This is the engine without its processes and sockets: what the pipeline costs on top shows
as the difference to it.
"""

from __future__ import annotations

from collections.abc import Callable

from protocol import AddRequest, TokenDeltas


def run(scheduler, runner, requests, first_id: int) -> int:
    """Add (prompt, params) requests with ids from first_id, then drain; returns the tokens."""
    eos = list(runner.model_config.eos_token_ids)
    for k, (prompt, params) in enumerate(requests):
        scheduler.add_request(AddRequest(first_id + k, prompt, params, eos))
    return drain(scheduler, runner)


def drain(scheduler, runner, on_deltas: Callable[[TokenDeltas], None] | None = None) -> int:
    """Step until every request finished; returns the tokens produced. `on_deltas` sees what
    each step added, as soon as the scheduler has processed it."""
    produced = 0
    while scheduler.has_unfinished():
        plan = scheduler.schedule()
        if plan is None:
            raise RuntimeError("the scheduler has unfinished requests but planned nothing")
        deltas = process(scheduler, runner.execute(plan))
        produced += sum(len(t) for t in deltas.token_ids)
        if on_deltas is not None:
            on_deltas(deltas)
    return produced


def process(scheduler, result) -> TokenDeltas:
    """The scheduler's deltas for one step's result; a failed request stops the benchmark."""
    deltas = scheduler.process_result(result)
    if any(e for e in deltas.errors):
        raise RuntimeError(f"request failed: {[e for e in deltas.errors if e]}")
    return deltas
