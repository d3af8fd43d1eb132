"""Judging a new request once, on arrival: can it ever run, and how long may it grow.

The one place where a request's length is judged against max_model_len and the KV pool, and
where max_tokens=None ("until the context is full") becomes a number. A request that passes
can always finish, even alone in the pool; one that fails never reaches a queue.
"""

from __future__ import annotations

import dataclasses

from protocol import AddRequest, ErrorKind, RequestError
from protocol.outcomes import invalid
from scheduler_proc.block_manager import BlockManager
from scheduler_proc.config import SchedulerConfig


def admission_error(
    req: AddRequest, config: SchedulerConfig, block_manager: BlockManager, in_use: bool
) -> RequestError | None:
    """Why the request can never run (naming the field to fix), or None if it can.

    in_use: whether its request id belongs to an unfinished request."""
    n = len(req.prompt_token_ids)
    max_len = config.max_model_len
    if in_use:
        return RequestError(ErrorKind.REQUEST_FAILED,
                            f"request id {req.request_id} is already in use")
    if n == 0:
        return invalid("the prompt is empty", "prompt")
    if n >= max_len:
        return invalid(f"the prompt has {n} tokens, but max_model_len is {max_len}: "
                       f"shorten the prompt", "prompt")
    if config.num_speculative_tokens:
        p = req.params  # structured outputs do go with it: the workers mask every proposal
        for name, off in (("presence_penalty", 0.0), ("frequency_penalty", 0.0),
                          ("repetition_penalty", 1.0)):
            if getattr(p, name) != off:
                return invalid(f"params.{name} is not supported with speculative decoding "
                               f"(this engine runs with --speculative)", f"params.{name}")
    max_tokens = req.params.max_tokens
    total = max_len if max_tokens is None else n + max_tokens
    if total > max_len:
        return invalid(f"the prompt has {n} tokens and params.max_tokens is {max_tokens}: "
                       f"together they exceed max_model_len {max_len}; lower max_tokens "
                       f"to at most {max_len - n}", "params.max_tokens")
    # KV is never written for the last sampled token, hence total - 1.
    if block_manager.blocks_for(total - 1) > config.num_kv_blocks:
        return invalid(f"the prompt ({n} tokens) + max_tokens ({total - n}) needs more KV "
                       f"cache than the whole pool ({config.kv_capacity_tokens} tokens)",
                       "params.max_tokens")
    return None


def with_resolved_max_tokens(req: AddRequest, max_model_len: int) -> AddRequest:
    """The request with max_tokens=None replaced by the room its prompt leaves."""
    if req.params.max_tokens is not None:
        return req
    room = max_model_len - len(req.prompt_token_ids)
    return dataclasses.replace(req, params=dataclasses.replace(req.params, max_tokens=room))
