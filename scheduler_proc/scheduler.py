"""The scheduler: which tokens of which sequences each step computes, and what they produced.

One token-count model, no prefill/decode phases: a running sequence is asked for its next
`num_new` tokens (1 when decoding, a chunk while prefilling), so one step mixes both.

Overlap: the process loop calls schedule() for step N+1 *before* process_result(N). So
schedule() advances num_computed when it plans, and plans every decoding sequence as if
it survives step N: its input for N+1 is the token N samples, which the workers already
hold (Sequence.num_pending counts such tokens). The hazards this creates are handled where
marked "Overlap hazard" below. With overlap off the loop simply alternates the two calls.
"""

from __future__ import annotations

import dataclasses
from collections import deque

from protocol import (
    OUT_OF_BAND_STEP,
    AddRequest,
    CachedSequences,
    ErrorKind,
    FinishReason,
    NewSequence,
    RequestError,
    StepPlan,
    StepResult,
    TokenDeltas,
)
from protocol.outcomes import invalid
from scheduler_proc.block_manager import BlockManager
from scheduler_proc.config import SchedulerConfig
from scheduler_proc.sequence import Sequence, SequenceStatus

RUNNING = SequenceStatus.RUNNING
WAITING = SequenceStatus.WAITING
FINISHED = SequenceStatus.FINISHED
STOP, LENGTH, ABORT, ERROR = (FinishReason.STOP, FinishReason.LENGTH, FinishReason.ABORT,
                              FinishReason.ERROR)

_NO_LOGPROBS: list[float] = []  # shared placeholder; dropped when the step has no logprobs


class Scheduler:
    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.block_manager = BlockManager(
            config.num_kv_blocks, config.block_size, config.enable_prefix_caching
        )
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order: the tail is preempted first
        self.seqs: dict[int, Sequence] = {}  # every unfinished sequence
        self._next_step_id = 0
        # Plans sent and not answered yet: (step id, sequences expected to sample, in plan order).
        self._inflight: deque[tuple[int, list[Sequence]]] = deque()
        # Ids the workers mirror but must forget; announced in the next plan.
        self._drops: list[int] = []
        # Sequences whose prefill chunk went into the last plan: their completed blocks enter
        # the prefix cache when the next plan is built, so a hit is only ever on KV written by
        # an earlier plan, never by a neighbour in the same batch.
        self._to_hash: list[Sequence] = []
        self._deltas = _DeltaBuffer()

    # ------------------------------------------------------------------ requests

    def add_request(self, req: AddRequest) -> None:
        """Queue a request, or finish it at once with an error delta if it can never run.

        The one place where a request's length is judged against max_model_len and the KV
        pool, and where max_tokens=None ("until the context is full") becomes a number."""
        error = self._admission_error(req)
        if error is not None:
            self._deltas.add(req.request_id, [], ERROR, error)
            return
        if req.params.max_tokens is None:
            room = self.config.max_model_len - len(req.prompt_token_ids)
            req = dataclasses.replace(req, params=dataclasses.replace(req.params, max_tokens=room))
        seq = Sequence(req.request_id, req.prompt_token_ids, req.params, req.eos_token_ids)
        self.seqs[seq.seq_id] = seq
        self.waiting.append(seq)

    def _admission_error(self, req: AddRequest) -> RequestError | None:
        cfg = self.config
        n = len(req.prompt_token_ids)
        max_len = cfg.max_model_len
        if req.request_id in self.seqs:
            return RequestError(ErrorKind.REQUEST_FAILED,
                                f"request id {req.request_id} is already in use")
        if n == 0:
            return invalid("the prompt is empty", "prompt")
        if n >= max_len:
            return invalid(f"the prompt has {n} tokens, but max_model_len is {max_len}: "
                           f"shorten the prompt", "prompt")
        max_tokens = req.params.max_tokens
        total = max_len if max_tokens is None else n + max_tokens
        if total > max_len:
            return invalid(f"the prompt has {n} tokens and params.max_tokens is {max_tokens}: "
                           f"together they exceed max_model_len {max_len}; lower max_tokens "
                           f"to at most {max_len - n}", "params.max_tokens")
        # KV is never written for the last sampled token, hence total - 1.
        if self.block_manager.blocks_for(total - 1) > cfg.num_kv_blocks:
            return invalid(f"the prompt ({n} tokens) + max_tokens ({total - n}) needs more KV "
                           f"cache than the whole pool ({cfg.kv_capacity_tokens} tokens)",
                           "params.max_tokens")
        return None

    def abort(self, request_ids: list[int], reason: FinishReason = ABORT) -> None:
        """Finish requests now and free every block they hold.

        Overlap hazard: an aborted sequence may still be in plans in flight; the tokens their
        results carry for it are ignored (it is FINISHED), and its blocks are only reused by
        plans sent after those, which workers run strictly later.
        """
        for rid in request_ids:
            seq = self.seqs.get(rid)
            if seq is None:  # already finished, or never admitted: nothing to do
                continue
            if seq.status is RUNNING:
                self.running.remove(seq)
            else:
                self.waiting.remove(seq)
            self._finish(seq, reason)
            self._deltas.add(rid, [], reason, None)

    def fail_all(self, error: RequestError) -> TokenDeltas | None:
        """Finish every unfinished request with an error delta (e.g. the engine died)."""
        for seq in list(self.seqs.values()):
            self._finish(seq, ERROR)
            self._deltas.add(seq.seq_id, [], ERROR, error)
        self.running.clear()
        self.waiting.clear()
        self._inflight.clear()
        self._to_hash.clear()
        return self.pop_deltas()

    def has_unfinished(self) -> bool:
        return bool(self.seqs)

    def has_inflight(self) -> bool:
        return bool(self._inflight)

    def pop_deltas(self) -> TokenDeltas | None:
        """Deltas not produced by a step (admission errors, aborts), if any are queued."""
        return self._deltas.take(OUT_OF_BAND_STEP, None)

    # ------------------------------------------------------------------ planning

    def schedule(self) -> StepPlan | None:
        """Plan the next step, or None when there is nothing to compute."""
        bm = self.block_manager
        for seq in self._to_hash:
            if seq.status is RUNNING:
                bm.hash_full_blocks(seq)
        self._to_hash.clear()

        budget = self.config.max_num_batched_tokens
        max_model_len = self.config.max_model_len
        bs = self.config.block_size
        running = self.running
        ids: list[int] = []
        num_new: list[int] = []
        new_blocks: list[list[int]] = []
        sampled: list[Sequence] = []
        preempted = False

        i = 0
        while i < len(running) and budget > 0:
            seq = running[i]
            target = len(seq.token_ids) + seq.num_pending
            # Overlap hazard: a token still in flight that is certain to end the sequence
            # (max_tokens or max_model_len reached) is not fed back; that would only compute
            # a token to discard, past the length the sequence was admitted for.
            if seq.num_pending and (
                target - seq.num_prompt_tokens >= seq.max_tokens or target >= max_model_len
            ):
                i += 1
                continue
            computed = seq.num_computed
            n = target - computed
            if n > budget:
                n = budget
            blocks: list[int] = []
            if computed + n > len(seq.block_table) * bs:
                alloc = bm.allocate(seq, computed + n)
                while alloc is None:
                    victim = running.pop()  # most recently admitted
                    self._preempt(victim)
                    preempted = True
                    if victim is seq:
                        break
                    alloc = bm.allocate(seq, computed + n)
                if alloc is None:
                    break
                blocks = alloc.new_block_ids
            ids.append(seq.seq_id)
            num_new.append(n)
            new_blocks.append(blocks)
            budget -= n
            seq.num_computed = computed + n
            if computed + n == target:
                seq.num_pending += 1
                sampled.append(seq)
            if n > 1:
                self._to_hash.append(seq)
            i += 1

        new_seqs: list[NewSequence] = []
        new_sampled: list[Sequence] = []
        if not preempted:  # under memory pressure admitting more would only thrash
            budget = self._admit(budget, new_seqs, new_sampled)

        if not ids and not new_seqs:
            return None
        plan = StepPlan(
            self._next_step_id,
            self._drops,
            new_seqs,
            CachedSequences(ids, num_new, new_blocks),
        )
        self._drops = []
        # Workers apply new_seqs before cached entries; results come back in that order.
        self._inflight.append((self._next_step_id, new_sampled + sampled))
        self._next_step_id += 1
        return plan

    def _admit(self, budget: int, out: list[NewSequence], sampled: list[Sequence]) -> int:
        """Move waiting sequences to running, each with its first chunk, while budget,
        max_num_seqs and free blocks allow. Returns the budget left."""
        bm = self.block_manager
        bs = self.config.block_size
        max_seqs = self.config.max_num_seqs
        waiting = self.waiting
        while waiting and budget > 0 and len(self.running) < max_seqs:
            seq = waiting[0]
            # Overlap hazard: a sequence preempted while its last sampled token is in flight
            # cannot be re-sent in full until that token arrives.
            if seq.num_pending:
                break
            # A resumed sequence looks its whole known text up: the hit covers whole blocks
            # and never the last token, and it starts from an empty block table, so it cannot
            # index past it.
            prefix = bm.find_cached_prefix(seq.token_ids)
            num_cached = prefix.num_blocks * bs
            n = min(len(seq.token_ids) - num_cached, budget)
            if bm.allocate(seq, num_cached + n, prefix) is None:
                break
            waiting.popleft()
            seq.status = RUNNING
            self.running.append(seq)
            out.append(
                NewSequence(
                    seq.seq_id,
                    list(seq.token_ids),
                    seq.num_prompt_tokens,
                    num_cached,
                    n,
                    list(seq.block_table),
                    seq.params,
                )
            )
            seq.on_worker = True
            seq.num_computed = num_cached + n
            budget -= n
            if seq.num_computed == len(seq.token_ids):
                seq.num_pending += 1
                sampled.append(seq)
            self._to_hash.append(seq)
        return budget

    def _preempt(self, seq: Sequence) -> None:
        """Recompute-preemption: free everything, requeue at the front, re-send in full later.

        Its computed full blocks are hashed first, so re-admission can hit them if they
        survive. Overlap hazard: a token sampled for it by a plan in flight still arrives
        and is appended (num_pending), and re-admission waits for it.
        """
        self.block_manager.hash_full_blocks(seq)
        self.block_manager.free(seq)
        seq.num_computed = 0
        seq.status = WAITING
        if seq.on_worker:
            self._drops.append(seq.seq_id)
            seq.on_worker = False
        self.waiting.appendleft(seq)

    # ------------------------------------------------------------------ results

    def process_result(self, result: StepResult) -> TokenDeltas:
        """Append the tokens of the oldest plan in flight, apply stop conditions, free the
        finished, and return the deltas for the detokenizer (with any queued out-of-band)."""
        if not self._inflight or self._inflight[0][0] != result.step_id:
            expected = self._inflight[0][0] if self._inflight else None
            raise ValueError(f"result for step {result.step_id}, expected step {expected}")
        _, seqs = self._inflight.popleft()
        if result.failed_seq_ids:
            self._fail_refused(result)
        seqs = self._match(seqs, result)
        tokens = result.token_ids
        logprobs = result.logprobs
        top_ids, top_lps = result.top_token_ids, result.top_logprobs
        deltas = self._deltas
        if top_ids is not None:
            deltas.pad_top()
        # Hot loop (one pass per decoding sequence per step): bound methods, no helpers.
        add_id, add_tokens = deltas.ids.append, deltas.tokens.append
        add_reason, add_error = deltas.reasons.append, deltas.errors.append
        add_logprobs = deltas.logprobs.append
        bs = self.config.block_size
        max_model_len = self.config.max_model_len
        bm = self.block_manager
        finished_running = False
        for k, seq in enumerate(seqs):
            seq.num_pending -= 1
            # Overlap hazard: this seq finished (or was aborted) after this plan was sent; the
            # token it produced is an extra one to discard. Its blocks were already freed,
            # which is safe: they can only be reused by plans sent after this one.
            if seq.status is FINISHED:
                continue
            tok = tokens[k]
            token_ids = seq.token_ids
            token_ids.append(tok)
            length = len(token_ids)
            reason = None
            if tok in seq.eos_ids or tok in seq.stop_ids:
                reason = STOP
            elif length - seq.num_prompt_tokens >= seq.max_tokens or length >= max_model_len:
                reason = LENGTH
            add_id(seq.seq_id)
            add_tokens([tok])
            add_reason(reason)
            add_error(None)
            add_logprobs(_NO_LOGPROBS if logprobs is None else [logprobs[k]])
            if top_ids is not None:
                deltas.top_ids.append([top_ids[k]])
                deltas.top_lps.append([top_lps[k]])
            if reason is not None:
                if seq.status is RUNNING:
                    finished_running = True
                else:
                    # Preempted while this token was in flight; it finished waiting.
                    self.waiting.remove(seq)
                self._finish(seq, reason)
            elif (
                seq.status is RUNNING
                and min(seq.num_computed, length) // bs > seq.num_hashed_blocks
            ):
                bm.hash_full_blocks(seq)
        if finished_running:
            self.running = [s for s in self.running if s.status is RUNNING]
        return deltas.take(result.step_id, logprobs is not None)

    def _fail_refused(self, result: StepResult) -> None:
        """Finish the requests whose sequences the workers refused, with their error.

        Finishing frees their blocks and lists them in the next plan's drops, which is what
        tells the workers to forget them. Until then (overlap) plans may still continue them;
        workers leave them out, and _match accepts their absence."""
        for sid, error in zip(result.failed_seq_ids, result.failed_errors, strict=True):
            seq = self.seqs.get(sid)
            if seq is None:  # aborted or finished meanwhile
                continue
            if seq.status is RUNNING:
                self.running.remove(seq)
            else:
                self.waiting.remove(seq)
            self._finish(seq, ERROR)
            self._deltas.add(sid, [], ERROR, RequestError(
                ErrorKind.REQUEST_FAILED, f"the engine could not run this request: {error}"))

    @staticmethod
    def _match(seqs: list[Sequence], result: StepResult) -> list[Sequence]:
        """The planned sequences in the order of the result (normally identical).

        A planned sequence may be missing only if the workers refused it (it is finished by
        then); its token in flight is accounted for here."""
        ids = result.seq_ids
        if len(result.token_ids) != len(ids):
            raise ValueError(f"step {result.step_id}: {len(ids)} sequences, "
                             f"{len(result.token_ids)} tokens")
        if len(ids) == len(seqs) and all(s.seq_id == i for s, i in zip(seqs, ids, strict=True)):
            return seqs
        by_id = {s.seq_id: s for s in seqs}
        try:
            matched = [by_id.pop(i) for i in ids]
        except KeyError as exc:
            raise ValueError(f"step {result.step_id}: unexpected sequence {exc}") from None
        for seq in by_id.values():
            if seq.status is not FINISHED:
                raise ValueError(f"step {result.step_id}: result has {len(ids)} sampled "
                                 f"entries, plan expected {len(seqs)}")
            seq.num_pending -= 1
        return matched

    def _finish(self, seq: Sequence, reason: FinishReason) -> None:
        """Mark finished and free its blocks once; the caller unlinks it from its queue."""
        assert seq.status is not FINISHED, f"sequence {seq.seq_id} finished twice"
        if seq.block_table:
            self.block_manager.hash_full_blocks(seq)
            self.block_manager.free(seq)
        seq.status = FINISHED
        seq.finish_reason = reason
        if seq.on_worker:
            self._drops.append(seq.seq_id)
            seq.on_worker = False
        del self.seqs[seq.seq_id]

    # ------------------------------------------------------------------ checks

    def check_integrity(self) -> None:
        """Raise AssertionError if any scheduler or block-pool invariant is broken."""
        self.block_manager.check_integrity(s.block_table for s in self.running)
        pending: dict[int, int] = {}
        for _, seqs in self._inflight:
            for s in seqs:
                pending[id(s)] = pending.get(id(s), 0) + 1
        problems = []
        for s in self.waiting:
            if s.status is not WAITING or s.block_table or s.on_worker:
                problems.append(f"waiting {s!r} holds blocks, is mirrored, or is not WAITING")
        for s in self.running:
            if s.status is not RUNNING or not s.on_worker:
                problems.append(f"running {s!r} is not RUNNING or not mirrored")
            if s.num_computed > len(s.block_table) * self.config.block_size:
                problems.append(f"{s!r} computes past its block table")
        live = {s.seq_id for s in self.waiting} | {s.seq_id for s in self.running}
        if live != set(self.seqs) or len(self.waiting) + len(self.running) != len(self.seqs):
            problems.append("waiting + running != unfinished sequences")
        for s in self.seqs.values():
            if s.num_pending != pending.get(id(s), 0):
                problems.append(f"{s!r} pending != tokens in flight")
        if problems:
            raise AssertionError("; ".join(problems))


class _DeltaBuffer:
    """Column buffers for one TokenDeltas message."""

    __slots__ = ("ids", "tokens", "reasons", "errors", "logprobs", "top_ids", "top_lps")

    def __init__(self) -> None:
        self.ids: list[int] = []
        self.tokens: list[list[int]] = []
        self.reasons: list[FinishReason | None] = []
        self.errors: list[RequestError | None] = []
        self.logprobs: list[list[float]] = []
        # Filled only once a step brings top alternatives; padded for the rows before it.
        self.top_ids: list[list[list[int]]] = []
        self.top_lps: list[list[list[float]]] = []

    def pad_top(self) -> None:
        missing = len(self.ids) - len(self.top_ids)
        self.top_ids.extend([] for _ in range(missing))
        self.top_lps.extend([] for _ in range(missing))

    def add(
        self,
        rid: int,
        tokens: list[int],
        reason: FinishReason | None,
        error: RequestError | None,
        logprob: float | None = None,
    ) -> None:
        self.ids.append(rid)
        self.tokens.append(tokens)
        self.reasons.append(reason)
        self.errors.append(error)
        self.logprobs.append([] if logprob is None else [logprob])

    def take(self, step_id: int, with_logprobs: bool | None) -> TokenDeltas | None:
        """Empty the buffer into a message. with_logprobs=None: only if non-empty."""
        if with_logprobs is None and not self.ids:
            return None
        if self.top_ids:
            self.pad_top()
        msg = TokenDeltas(
            step_id,
            self.ids,
            self.tokens,
            self.reasons,
            self.errors,
            self.logprobs if with_logprobs else None,
            *((self.top_ids, self.top_lps) if self.top_ids and with_logprobs else (None, None)),
        )
        self.__init__()
        return msg
