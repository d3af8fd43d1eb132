"""ModelRunner: one rank's model shard, KV pool, mirror and sampler; executes StepPlans.

A step: apply the plan to the mirror, build one unified extend batch, run the model (a CUDA
graph where one is captured for the step's shape: gpu_workers.step_graphs), compute logits
only for entries that reach the end of their known tokens, sample on rank 0 and broadcast
the ids so every rank's mirror appends them. The only host sync per step is the copy of the
sampled ids.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
import torch.distributed as dist

from gpu_workers.batch import StepBatch, build_batch
from gpu_workers.block_mover import BlockMover
from gpu_workers.config import ModelConfig, WorkerConfig, check_model_len
from gpu_workers.cuda_sizing import part, size_kv_pool
from gpu_workers.grammar_book import GrammarBook
from gpu_workers.graph_sampling import graph_sample_inputs, graph_samplers, graph_tokens
from gpu_workers.host_tier import HostTier
from gpu_workers.kv_cache import KVCache
from gpu_workers.layers.attention import resolve_backend
from gpu_workers.layers.cpu_linear import use_onednn_weights
from gpu_workers.layers.parallel import TPInfo
from gpu_workers.layers.peer_all_reduce import create_peer_all_reduce
from gpu_workers.loader import load_weights
from gpu_workers.models import CausalLM
from gpu_workers.pending_step import Once, PendingStep, patch_in_flight, pending_patch
from gpu_workers.sampler import Sampler, sampled_logprobs, top_logprobs
from gpu_workers.sequence_table import SequenceTable
from gpu_workers.speculative import SpecStep, entry_proposals, prepare_proposals, settle_verified
from gpu_workers.speculative.draft import DraftProposer
from gpu_workers.step_graphs import StepGraphs
from gpu_workers.step_timer import BusyTimes
from gpu_workers.token_layout import bucket_width, entry_offsets, needed_width
from gpu_workers.warm_up import warm_up_kernels
from protocol import StepPlan, StepResult
from protocol.startup_phases import PhaseClock


class ModelRunner:
    def __init__(self, config: WorkerConfig, rank: int = 0, world_size: int = 1,
                 progress: Callable[[str], None] | None = None) -> None:
        """`progress` hears what start-up is doing (the launcher prints it for the user)."""
        progress = progress or (lambda text: None)
        self.startup = clock = PhaseClock()  # how long each phase took: the worker's Ready
        self.config = config
        self.rank, self.world_size = rank, world_size
        if config.device == "cuda" and not torch.cuda.is_available():
            raise RuntimeError("device 'cuda' requested but CUDA is not available")
        self.device = torch.device("cuda", torch.cuda.current_device()) \
            if config.device == "cuda" else torch.device("cpu")
        self.model_config = mc = ModelConfig.for_worker(config)
        check_model_len(config, mc)
        torch.manual_seed(config.seed)
        self.backend = resolve_backend(config.attention_backend, config.device, mc.dtype,
                                       mc.head_dim, config.block_size, mc.kv_dtype)
        self.tp = TPInfo(rank, world_size, create_peer_all_reduce(mc.dtype, self.device)
                         if config.peer_all_reduce else None)
        progress(f"loading weights ({mc.dtype}, KV {mc.kv_dtype}, {self.backend} attention)")
        with torch.inference_mode():
            self.model = CausalLM(mc, self.tp, self.backend, self.device, config.max_seq_tokens)
            load_weights(self.model, config.model)
            use_onednn_weights(self.model)
        self.drafter: DraftProposer | None = None
        if config.speculative == "draft":  # before sizing: its pool shares the KV budget
            progress(f"loading the draft model {config.draft_model}")
            self.drafter = DraftProposer(config, mc, self.tp, self.device)
        clock.mark("weights")
        self.stream = torch.cuda.current_stream(self.device) if config.device == "cuda" else None
        """Where every step runs (no other stream is ever made current), kept: a look-up
        costs more host time than recording an event on it."""
        self.sampler, self.busy = Sampler(self.device, config.seed), BusyTimes(self.stream)
        self.grammars = GrammarBook(config.model, mc.vocab_size) if rank == 0 else None
        """Rank 0's grammar matchers (structured outputs), loaded at their first use."""
        self.graphs: StepGraphs | None = None
        self.table: SequenceTable | None = None
        self._unsettled: list[PendingStep] = []
        """Launched steps of self.table whose tokens are not in the mirror yet, oldest first."""
        progress("sizing the KV cache")  # on CUDA by a profiling forward unless it is cached
        blocks = self.num_kv_blocks = size_kv_pool(self, rank, self.drafter)
        self.kv_cache = KVCache(mc, blocks, config.block_size, self.device, config.kv_pool_mappable)
        self.kv_cache.bind(self.model.attention_layers())
        part(clock, self.device, "kv.pool")
        self.host_tier = HostTier(self.kv_cache.storage, config.kv_offloading_size,
                                  world_size, self.drafter)  # pinned while idle: pin_idle
        self.num_host_slots = self.host_tier.slots
        if self.drafter is not None:
            self.drafter.bind_cache(self.num_kv_blocks, world_size)
        self.table = self.new_table(self.num_kv_blocks)
        clock.mark("kv")
        if self.device.type == "cuda":
            warm_up_kernels(self)
            clock.mark("warm-up")
        if self.device.type == "cuda" and not config.enforce_eager:
            with torch.inference_mode():
                samplers = graph_samplers(self.model, self.sampler, world_size,
                                          masks=self.grammars is not None)
                self.graphs = StepGraphs(self.model, config, self.device, progress, **samplers)
                if self.drafter is not None:
                    progress("capturing CUDA graphs for the draft model")
                    self.drafter.capture_graphs(pool=self.graphs.pool)
            clock.mark("graphs")

    @property
    def mover(self) -> BlockMover | None:
        """The host tier's block mover (None: no tier)."""
        return self.host_tier.mover

    def new_table(self, num_blocks: int | None = None) -> SequenceTable:
        c = self.config
        return SequenceTable(c.mirror_rows, c.max_seq_tokens,
                             c.max_blocks_per_seq, vocab_size=self.model_config.vocab_size,
                             num_blocks=num_blocks, block_size=c.block_size)

    def launch_on(self, plan: StepPlan, table: SequenceTable) -> PendingStep:
        """Queue a step on another table than the serving one, on the current stream, and
        return without waiting (start-up's kernel recording runs it inside a capture)."""
        saved = self.stream
        if self.device.type == "cuda":
            self.stream = torch.cuda.current_stream(self.device)
        try:
            with torch.inference_mode():
                return self._launch(plan, table)
        finally:
            self.stream = saved

    # ----------------------------------------------------------------- stepping

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> StepResult | None:
        """Run one step to the end (rank 0 returns its result, other ranks None)."""
        return self.finish(self.launch(plan))

    @torch.inference_mode()
    def launch(self, plan: StepPlan, meanwhile: Callable[[], None] | None = None
               ) -> PendingStep:
        """Queue one step on the device and return without waiting for its tokens.

        The plan may continue sequences whose newest token the step still in flight is
        sampling: that token's value is copied on the device into this step's inputs, so the
        two steps run back to back with no host round trip between them.

        `meanwhile` runs once the step's work is queued (a constrained step's: its forward,
        before the masks), ahead of its host bookkeeping: the worker finishes the step in
        flight there, so that step's result leaves as early as it can."""
        once = Once(meanwhile)
        pending = self._launch(plan, self.table, once)
        once()  # a step with nothing to queue
        if self.grammars is not None:  # rows whose grammar allowed nothing: its result's
            pending.ended = self.grammars.take_dead_ends(pending)
        return pending

    def finish(self, pending: PendingStep,
               deliver: Callable[[StepResult], None] | None = None) -> StepResult | None:
        """Wait for a launched step's tokens, make its result (rank 0), settle the tokens in
        the mirror. `deliver` hears the result before the mirror is updated: the worker sends
        it from there, so the scheduler's work on it overlaps the settling."""
        pending.wait()
        result = None
        if self.rank == 0:
            result = pending.result(self.busy.take())
            if deliver is not None:
                deliver(result)
        self._settle(pending)
        return result

    def run_on(self, plan: StepPlan, table: SequenceTable) -> StepResult | None:
        """Run one step on another table than the serving one (start-up's scratch steps)."""
        with torch.inference_mode():
            return self.finish(self._launch(plan, table))

    def _launch(self, plan: StepPlan, table: SequenceTable,
                meanwhile: Callable[[], None] = lambda: None) -> PendingStep:
        in_flight = None
        if table is self.table and self._unsettled:
            for older in self._unsettled[:-1]:  # only the newest step's tokens are patched in
                self._settle(older)
            in_flight = self._unsettled[-1]
        if plan.moves and self.mover is not None and table is self.table:
            self.mover.apply(plan.moves)
        seq_ids, rows, num_new = table.apply(plan)
        failures = table.new_failures
        if self.grammars is not None and table is self.table:
            self.grammars.track(plan, table)
        if len(rows) == 0:
            return PendingStep.empty(plan.step_id, table, failures)
        if in_flight is not None:
            # Penalties and proposers read the token history on the host: such a step waits
            # for the one in flight (lookahead then only helps the steps that do neither).
            # Grammar matchers wait later, once this step's forward is queued (_sample).
            reads_history = table.uses_penalties(rows) | self._proposes_from_history(table)
            if reads_history.any() and ((table.pending_pos[rows] >= 0) & reads_history).any():
                self._settle(in_flight)
        spec, run_new = None, num_new
        if self.drafter is not None and table is self.table:
            spec = self.drafter.propose(table, rows, num_new, table.step_spec, self.sampler,
                                        self.grammars)
            if spec is not None:
                run_new = num_new + spec.num_verify
        elif self.config.speculative == "ngram" and table.step_spec.any():
            # Proposals read the settled history (the step in flight was settled above).
            spec = prepare_proposals(table, rows, num_new, table.step_spec,
                                     self.config.ngram_size)
            run_new = num_new + spec.num_verify
        graphs, key, width = None, None, None
        if self.graphs is not None and table is self.table:
            graphs, key = self.graphs.select(num_new, run_new)
        start = table.num_computed[rows]
        if self.device.type == "cuda" and graphs is None:
            # Block tables as wide as the longest context needs, in buckets: the decode
            # split grid is sized from the width, so few widths make few split counts.
            # A graph's step takes the exact width (gpu_workers.graph_tables).
            width = bucket_width(needed_width(int((start + run_new).max()), self.config.block_size),
                                 self.config.max_blocks_per_seq)
        layout = {} if graphs is None else graphs.layout(key)
        drawn = None if spec is not None else graph_sample_inputs(graphs, table, rows,
                                                                 num_new, self.sampler)
        extra = dict(drawn or {})
        if in_flight is not None:
            offsets = entry_offsets(run_new, layout.get("q_per_seq"))  # None: packed
            extra |= pending_patch(table, rows, start, num_new, offsets)
        batch = build_batch(table, rows, run_new, self.config.block_size, self.device,
                            block_width=width,
                            num_verify=None if spec is None else spec.num_verify,
                            extra=extra, sample=drawn is None, **layout)
        if in_flight is not None:
            assert np.array_equal(offsets, batch.token_offsets), "patch offsets off the layout"
            patch_in_flight(batch, in_flight)
        table.num_computed[rows] += num_new
        timer = self.busy.start() if table is self.table and self.rank == 0 else None
        if graphs is not None:
            hidden = graphs.run(batch.input_ids, batch.positions, batch.attn, key)
        else:
            hidden = self.model(batch.input_ids, batch.positions, batch.attn)
        if len(batch.sample_rows) == 0:
            self.busy.stop(timer)
            return PendingStep.empty(plan.step_id, table, failures)
        logprobs = top = None
        if drawn is not None:
            tokens = graph_tokens(graphs, key, batch.sample_rows, table, self.grammars,
                                  self._grammars_ready(table, batch.sample_rows, meanwhile))
        else:
            tokens, logprobs, top = self._sample(hidden, batch, table, spec, meanwhile)
        self.busy.stop(timer)
        meanwhile()
        if spec is not None:
            pending = settle_verified(PendingStep(
                step_id=plan.step_id, table=table,
                seq_ids=[seq_ids[i] for i in batch.sample_entries], rows=batch.sample_rows,
                positions=start, epochs=table.epoch[batch.sample_rows], tokens=tokens,
                logprobs=logprobs, top=top, failures=failures), batch, spec, self.stream)
            self._accept_grammars(pending, pending.epochs, pending.counts)
            return pending
        pos, epochs = table.append_placeholders(batch.sample_rows)
        pending = PendingStep(
            step_id=plan.step_id, table=table,
            seq_ids=[seq_ids[i] for i in batch.sample_entries], rows=batch.sample_rows,
            positions=pos, epochs=epochs, tokens=tokens, logprobs=logprobs, top=top,
            failures=failures)
        pending.copy_to_host(self.stream)
        if table is self.table:
            self._unsettled.append(pending)
        return pending

    def _proposes_from_history(self, table: SequenceTable) -> np.ndarray | bool:
        """Entries of this step whose proposals read their tokens on the host: every entry
        with a draft (it catches up on each entry's tokens), those allowed to speculate with
        n-gram lookup."""
        if self.drafter is not None:
            return True
        if self.config.speculative == "ngram":
            return table.step_spec > 0
        return False

    def _settle(self, pending: PendingStep) -> None:
        if pending.settled:
            return
        pending.wait()
        pending.table.fill_tokens(pending.rows, pending.positions, pending.epochs,
                                  pending.host_tokens)
        self._accept_grammars(pending, pending.epochs)
        pending.settled = True
        if pending in self._unsettled:
            self._unsettled.remove(pending)

    def _accept_grammars(self, pending: PendingStep, epochs: np.ndarray,
                         counts: np.ndarray | None = None) -> None:
        """Advance the constrained rows' matchers by the tokens the step kept (counts: per
        entry, after a verify)."""
        if self.grammars is not None and pending.table is self.table and len(pending.rows):
            on = pending.table.constrained[pending.rows]
            if on.any():
                self.grammars.accept(pending.rows, epochs, pending.host_tokens, on, counts)

    def _sample(self, hidden: torch.Tensor, batch: StepBatch, table: SequenceTable,
                spec: SpecStep | None, meanwhile: Callable[[], None]
                ) -> tuple[torch.Tensor, torch.Tensor | None, tuple | None]:
        """Sampled ids [R] int64, on rank 0 their logprobs and the requested top
        alternatives ([R, k] ids and logprobs), all on the device. Draft proposals drawn
        from q are settled by rejection sampling (gpu_workers.speculative.rejection)."""
        logits = self.model.compute_logits(hidden.index_select(0, batch.logits_indices))
        lp = top = None
        if self.rank == 0:
            constrained = self._grammars_ready(table, batch.sample_rows, meanwhile)
            if constrained is not None:
                self.grammars.mask_logits(
                    logits, batch.sample_rows, table.epoch[batch.sample_rows], constrained,
                    None if spec is None else entry_proposals(
                        table, batch.sample_rows, spec.num_verify[batch.sample_entries]))
            tokens, lp = self.sampler(logits, batch.sampling)
            if spec is not None and self.drafter is not None and self.drafter.resample(
                    logits, table, batch.sample_entries, batch.sample_rows,
                    spec.num_verify[batch.sample_entries], tokens, self.sampler) and lp is not None:
                lp = sampled_logprobs(logits, tokens)
            if batch.sampling.top_logprobs:
                top = top_logprobs(logits, batch.sampling.top_logprobs)
        else:
            tokens = torch.empty(len(batch.logits_indices), dtype=torch.int64, device=self.device)
        if self.world_size > 1:
            dist.broadcast(tokens, src=0)
        return tokens, lp, top

    def _grammars_ready(self, table: SequenceTable, rows: np.ndarray,
                        meanwhile: Callable[[], None]) -> np.ndarray | None:
        """Which entries a grammar holds (None: none), once their matchers have accepted
        their tokens in flight: waited for here, with this step's forward queued; that step's
        result leaves first, then the masks are made."""
        if self.grammars is None or table is not self.table:
            return None
        constrained = table.constrained[rows]
        if not constrained.any():
            return None
        if (table.pending_pos[rows[constrained]] >= 0).any():
            meanwhile()
            for older in list(self._unsettled):
                self._settle(older)
        return constrained
