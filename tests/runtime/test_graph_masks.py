"""Structured outputs sampled inside the decode graphs: the bitmask buffer the graphs read
(row i for entry i, all ones elsewhere), the function the constrained graph captures (run
eagerly, it gives the eager path's tokens), and whole runs through the graph path (its
capture stood in by eager replays on the CPU, real CUDA graphs on a GPU) that give the
tokens of the runner sampling after the forward."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch
from rt_helpers import make_runner
from test_lookahead import LookaheadWorker, SyncWorker, generate
from test_sampler_fast import batch

from gpu_workers.graph_bitmask import GraphBitmask, padded_rows
from gpu_workers.graph_sampling import graph_masked_sample_fn
from gpu_workers.sampler import Sampler
from protocol import AddRequest, FinishReason, SamplingParams
from protocol.structured_outputs import structured_from_user

CPU = torch.device("cpu")
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["ok", "color"],
          "properties": {"ok": {"type": "boolean"}, "color": {"enum": ["red", "green"]}}}
REGEX = r"[a-z]{2,6}( [a-z]{2,6}){2,5}\."
CHOICES = ["alpha", "beta gamma"]
SPECS = [{"json": SCHEMA}, {"regex": REGEX}, {"choice": CHOICES}]
EOS = 2  # the tiny model's <|im_end|>
DEAD_STRING = {"type": "object", "required": ["a"],
               "properties": {"a": {"type": "string", "pattern": r"[^\s\S]"}}}


def test_padded_rows_repeat_the_last_row_up_to_a_multiple_of_16():
    assert padded_rows(1).tolist() == [0] * 16
    assert padded_rows(16).tolist() == list(range(16))
    assert padded_rows(17).tolist() == list(range(17)) + [16] * 15
    assert padded_rows(24).dtype == np.int32 and len(padded_rows(24)) == 32


def test_the_buffer_holds_this_steps_masks_and_all_ones_elsewhere():
    bitmask = GraphBitmask(8, 100, CPU)
    assert bitmask.width == 4 and bitmask.rows.shape == (8, 4)
    assert (bitmask.rows == -1).all()  # no step yet: nothing masked

    def step(bs: int, fill: dict[int, int]) -> torch.Tensor:
        host = bitmask.host()
        for row, word in fill.items():
            host[row] = word
        bitmask.send(bs, list(fill))
        return bitmask.rows.clone()

    rows = step(4, {1: 5, 3: 7})
    assert rows[1].tolist() == [5] * 4 and rows[3].tolist() == [7] * 4
    assert (rows[[0, 2, 4, 5, 6, 7]] == -1).all()
    rows = step(8, {0: 9})  # rows 1 and 3 were an earlier step's: all ones again
    assert rows[0].tolist() == [9] * 4 and (rows[1:] == -1).all()
    step(8, {6: 3})
    rows = step(4, {})  # a smaller step sends its rows; row 6 is reset on the host
    assert (rows[:4] == -1).all() and rows[6].tolist() == [3] * 4
    assert (step(8, {}) == -1).all()  # and reaches the device with the next step that reads it
    assert bitmask.indices(3).tolist() == padded_rows(3).tolist()
    assert bitmask.indices(3) is bitmask.indices(3)  # made once: the graph's fixed input


def _book_rows(runner, tokenizer) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Five entries in mirror rows 7..3: json (after its opening brace), unconstrained, regex,
    choice, json again (nothing generated yet)."""
    book = runner.grammars
    specs = [SPECS[0], None, SPECS[1], SPECS[2], SPECS[0]]
    generated = [tokenizer.encode('{"ok'), [], [], [], []]
    rows, epochs = np.arange(7, 2, -1), np.full(5, 4)
    for row, spec, tokens in zip(rows, specs, generated, strict=True):
        if spec is not None:
            book.add(int(row), 4, structured_from_user(spec), tokens)
    return rows, epochs, np.array([s is not None for s in specs])


@pytest.mark.parametrize("temperature", [0.0, 0.8], ids=["greedy", "seeded"])
def test_the_captured_function_gives_the_eager_paths_tokens(tiny_qwen3_dir, temperature):
    """Graph rows 0..4 are the entries, 5..7 padding: the buffer filled by the matchers and
    the function the graph captures, called eagerly, draw what the eager path draws (its
    compact rows, xgrammar's apply, the sampler), and the mask changes the tokens."""
    from transformers import AutoTokenizer

    runner = make_runner(tiny_qwen3_dir)
    rows, epochs, constrained = _book_rows(runner, AutoTokenizer.from_pretrained(tiny_qwen3_dir))
    vocab, n, bs = runner.model_config.vocab_size, 5, 8
    hidden = torch.randn(bs, runner.model_config.hidden_size,
                         generator=torch.Generator().manual_seed(3)) * 4
    seeds = np.array([11, 2**40 + 5, -9, 123, 7, 0, 0, 0], np.int64)
    inv = np.full(bs, 0.0 if temperature == 0 else np.float32(1) / np.float32(temperature),
                  np.float32)
    with torch.inference_mode():
        logits = runner.model.compute_logits(hidden[:n])
        free = logits.clone()
        runner.grammars.mask_logits(logits, rows, epochs, constrained)
        seeded = [] if temperature == 0 else [(i, int(seeds[i])) for i in range(n)]
        b = batch([temperature] * n, [0] * n, [1.0] * n, [0.0] * n, seeded)
        sampler = Sampler("cpu", 0, one_pass=True)
        eager = sampler(logits, b)[0]
        unmasked = sampler(free, b)[0]

        bitmask = GraphBitmask(bs, vocab, CPU)
        runner.grammars.fill_graph_rows(bitmask, bs, rows, epochs, constrained)
        assert (bitmask.rows[[1, 5, 6, 7]] == -1).all()  # unconstrained and padding rows
        assert not (bitmask.rows[[0, 2, 3, 4]] == -1).all(dim=1).any()
        fn = graph_masked_sample_fn(runner.model, sampler, 1, vocab)
        drawn = fn(hidden, torch.from_numpy(inv), torch.from_numpy(seeds),
                   bitmask.rows[:bs], bitmask.indices(bs))
    assert drawn[:n].tolist() == eager.tolist()
    assert drawn[1] == unmasked[1]  # the unconstrained entry draws as without a grammar
    assert drawn[:n].tolist() != unmasked.tolist()
    assert graph_masked_sample_fn(runner.model, Sampler("cpu", 0), 1, vocab) is None
    assert graph_masked_sample_fn(runner.model, sampler, 2, vocab) is None


def _requests(tokenizer, temperature: float, seed: int | None) -> list[AddRequest]:
    texts = ['{"ok": true, "color": "red"} {"ok"', "alpha beta gamma. alpha",
             "say beta gamma or alpha:", "hello hello hello", "one two three"]
    reqs = []
    for rid, text in enumerate(texts):
        extra = {"structured_outputs": SPECS[rid]} if rid < len(SPECS) else {}
        params = SamplingParams(temperature=temperature, seed=seed, max_tokens=30, **extra)
        reqs.append(AddRequest(rid, tokenizer.encode(text), params, [EOS]))
    return reqs


def _check_grammars(tokenizer, out, all_stop: bool = True) -> None:
    """The constrained requests' texts are of their grammars' languages: all of them ended
    by their grammar (all_stop), or those that were (another device's numbers may draw a
    longer text that max_tokens cuts)."""
    texts = {rid: tokenizer.decode([t for t in ids if t != EOS]) for rid, (ids, _) in out.items()}
    stopped = [out[rid][1] is FinishReason.STOP for rid in range(len(SPECS))]
    assert all(stopped) or not all_stop, out
    checks = [lambda t: json.loads(t).keys() == {"ok", "color"},
              lambda t: re.fullmatch(REGEX, t), lambda t: t in CHOICES]
    for rid, check in enumerate(checks):
        assert not stopped[rid] or check(texts[rid]), texts[rid]


def _one_pass(runner) -> None:
    runner.sampler.one_pass = True


def _eager_graphs(monkeypatch, runners: list):
    """An attach() giving a runner decode graphs whose capture is stood in by eager replays
    (test_static_inputs); each runner it changes is appended to `runners`."""
    from test_static_inputs import _record_eagerly

    import gpu_workers.decode_graphs as decode_graphs
    import gpu_workers.prefill_graphs as prefill_graphs
    from gpu_workers.graph_sampling import graph_samplers
    from gpu_workers.step_graphs import StepGraphs

    for module in (decode_graphs, prefill_graphs):
        monkeypatch.setattr(module, "record", _record_eagerly)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)

    def with_graphs(runner) -> None:
        _one_pass(runner)
        with torch.inference_mode():
            runner.graphs = StepGraphs(runner.model, runner.config, runner.device,
                                       lambda text: None,
                                       **graph_samplers(runner.model, runner.sampler, 1, True))
        runners.append(runner)

    return with_graphs


@pytest.mark.parametrize("temperature,seed", [(0.0, None), (0.9, 17)], ids=["greedy", "seeded"])
def test_constrained_steps_sample_in_the_graph_on_the_cpu(tiny_qwen3_dir, monkeypatch,
                                                          temperature, seed):
    """The graph paths with capture stood in by eager replays (test_static_inputs): decode
    steps with constrained rows replay their size's masked sampling graph, step by step and
    with lookahead, and give the tokens of the runner without graphs."""
    from transformers import AutoTokenizer

    runners = []
    with_graphs = _eager_graphs(monkeypatch, runners)
    tokenizer = AutoTokenizer.from_pretrained(tiny_qwen3_dir)
    reqs = _requests(tokenizer, temperature, seed)
    kw = dict(max_model_len=128, max_num_batched_tokens=128)
    plain, _ = generate(tiny_qwen3_dir, reqs, SyncWorker, 1 << 20, attach=_one_pass, **kw)
    _check_grammars(tokenizer, plain)
    sync, _ = generate(tiny_qwen3_dir, reqs, SyncWorker, 1 << 20, attach=with_graphs, **kw)
    ahead, _ = generate(tiny_qwen3_dir, reqs, LookaheadWorker, 1 << 20, attach=with_graphs,
                        **kw)
    assert sync == plain and ahead == plain
    for runner in runners:
        decode = runner.graphs.decode
        assert decode.masks and decode.masked_steps > 0
        assert set(decode.masked_graphs) == set(decode.sizes)  # all at the first one
        assert runner.grammars.times.steps >= decode.masked_steps
    # Without a constrained request nothing of it runs: no masked graph, no mask.
    generate(tiny_qwen3_dir, reqs[len(SPECS):], SyncWorker, 1 << 20, attach=with_graphs, **kw)
    decode = runners[-1].graphs.decode
    assert decode.samples and not decode.masked_graphs and decode.masked_steps == 0
    assert runners[-1].grammars.times.steps == 0


def test_a_grammar_with_no_next_token_ends_its_request_in_the_graph_and_out(
        tiny_qwen3_dir, monkeypatch):
    """A regex that matches nothing (its first, eager, step) and a schema whose string
    matches nothing (dead once its key is written: a decode step, the graph's bitmask): each
    request ends with an error, step by step and with lookahead, the token drawn from nothing
    not kept; the requests beside them run as they would alone."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_qwen3_dir)
    reqs = [AddRequest(rid, tokenizer.encode("hello there"), SamplingParams(
        temperature=0, max_tokens=12, **extra), [EOS]) for rid, extra in enumerate([
            {"structured_outputs": structured_from_user({"regex": r"[^\s\S]"})},
            {"structured_outputs": structured_from_user({"json": DEAD_STRING})},
            {"structured_outputs": structured_from_user({"regex": REGEX})}, {}])]
    kw = dict(max_model_len=128, max_num_batched_tokens=128)
    alone, _ = generate(tiny_qwen3_dir, reqs[2:], SyncWorker, 1 << 20, attach=_one_pass, **kw)
    with_graphs = _eager_graphs(monkeypatch, [])
    for worker in (SyncWorker, LookaheadWorker):
        out, _ = generate(tiny_qwen3_dir, reqs, worker, 1 << 20, attach=with_graphs, **kw)
        assert out[0] == ([], FinishReason.ERROR)
        assert out[1][1] is FinishReason.ERROR
        assert tokenizer.decode(out[1][0]) == '{"a": "'  # the next token was not kept
        assert {rid: out[rid] for rid in (2, 3)} == alone


@pytest.mark.gpu
@pytest.mark.parametrize("temperature,seed", [(0.0, None), (0.9, 17)], ids=["greedy", "seeded"])
def test_constrained_steps_sample_in_cuda_graphs_as_without_them(tiny_qwen3_dir, temperature,
                                                                 seed):
    """On a GPU: JSON-schema, regex and choice requests beside unconstrained ones, with CUDA
    graphs (constrained decode steps replay their size's masked sampling graph, every size
    captured at the first) and with enforce_eager, step by step and with lookahead: the same
    tokens."""
    import gc

    from transformers import AutoTokenizer

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    tokenizer = AutoTokenizer.from_pretrained(tiny_qwen3_dir)
    reqs = _requests(tokenizer, temperature, seed)
    runners = []
    out = {}
    for enforce_eager in (True, False):
        for worker_cls in (SyncWorker, LookaheadWorker):
            gc.collect()
            torch.cuda.empty_cache()
            free, total = torch.cuda.mem_get_info()
            util = min(0.95, (total - free) / total + 0.02)
            out[enforce_eager, worker_cls] = generate(
                tiny_qwen3_dir, reqs, worker_cls, None, attach=runners.append, device="cuda",
                gpu_memory_utilization=util, enforce_eager=enforce_eager)[0]
            _check_path(runners.pop(), in_graph=not enforce_eager)
    eager = out[True, SyncWorker]
    _check_grammars(tokenizer, eager, all_stop=False)
    assert all(o == eager for o in out.values())


@pytest.mark.parametrize("in_graph", [False, True], ids=["eager", "graph_buffer"])
def test_the_benchmarks_mask_time_runs_either_path(tiny_qwen3_dir, in_graph):
    """`nanopipe bench constrained` times the path decode steps take on its device: the
    decode graphs' buffer on CUDA (forced here on the CPU), the eager rows elsewhere."""
    from frontend.bench.workloads.constrained import mask_times

    times = mask_times(tiny_qwen3_dir, "cpu", [1, 3], 2, in_graph=in_graph)
    assert list(times) == [1, 3] and all(ms > 0 for ms in times.values())


def _check_path(runner, in_graph: bool) -> None:
    """Constrained decode steps were sampled in their graphs (in_graph), or none ran."""
    if not in_graph:
        assert runner.graphs is None
        return
    decode = runner.graphs.decode
    assert decode.masks and decode.masked_steps > 0, "no step masked in a graph"
    assert set(decode.masked_graphs) == set(decode.sizes)
