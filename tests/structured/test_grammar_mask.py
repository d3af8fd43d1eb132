"""GrammarBook's masks land on the constrained rows alone, wherever those rows sit in the
batch (the compact host rows are scattered on the device when they are not the first ones),
whatever the number of fill threads, and on the GPU as on the CPU. A mask that allows nothing
ends its request where the step draws from it: in a verify step, only where the verify
accepted the proposals that lead to it."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from grammar_reference import allowed_after

from frontend.bench.workloads.constrained import SCHEMA, write_json_tokenizer
from gpu_workers import grammar_book
from gpu_workers.grammar_book import GrammarBook
from protocol.structured_outputs import structured_from_user

VOCAB = 700
SPEC = structured_from_user({"json": SCHEMA})
PREFIXES = ['', '{"title": "ab', '{"title": "x", "rating": ',
            '{"title": "x", "rating": 3, "tags": [']


@pytest.fixture(scope="module")
def json_dir(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("json_tokenizer")
    write_json_tokenizer(path, VOCAB)
    return str(path)


def _token_ids(book: GrammarBook, text: str) -> list[int]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(book.model_dir)
    return [tok.convert_tokens_to_ids(ch) for ch in text]  # one token per character


def _allowed(book: GrammarBook, prefix: str) -> torch.Tensor:
    return allowed_after(book.compiled(SPEC).result(), _token_ids(book, prefix), VOCAB)


def _masked(book: GrammarBook, constrained: list[bool], device: str = "cpu",
            dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Row i of a batch is constrained (an entry whose grammar has read PREFIXES[i % 4])."""
    n = len(constrained)
    for i, on in enumerate(constrained):
        if on:
            book.add(i, 3, SPEC, _token_ids(book, PREFIXES[i % len(PREFIXES)]))
    logits = torch.zeros(n, VOCAB, dtype=dtype, device=device)
    book.mask_logits(logits, np.arange(n), np.full(n, 3), np.array(constrained))
    return logits.cpu() == 0


@pytest.mark.parametrize("constrained", [
    [True, True, False, False],  # the first rows: no scatter
    [False, True, False, True, False],  # scattered
    [True] * 9,
])
def test_masks_land_on_the_constrained_rows_alone(json_dir, constrained):
    book = GrammarBook(json_dir, VOCAB)
    allowed = _masked(book, constrained)
    for i, on in enumerate(constrained):
        free = torch.ones(VOCAB, dtype=torch.bool)
        expected = _allowed(book, PREFIXES[i % len(PREFIXES)]) if on else free
        assert torch.equal(allowed[i], expected), i
    assert book.times.rows == sum(constrained)


def test_a_large_batch_filled_by_threads_masks_as_one_thread(json_dir, monkeypatch):
    pattern = [i % 3 != 1 for i in range(40)]
    serial = _masked(GrammarBook(json_dir, VOCAB), pattern)
    monkeypatch.setattr(grammar_book, "FILL_ROWS_PER_THREAD", 4)
    monkeypatch.setattr(grammar_book, "_CORES", 8)
    book = GrammarBook(json_dir, VOCAB)
    assert torch.equal(_masked(book, pattern), serial)
    assert list(book._batches) == [4]


@pytest.mark.gpu
@pytest.mark.parametrize("n", [1, 5, 16, 17, 40])
def test_on_the_gpu_as_on_the_cpu(json_dir, n):
    pattern = [i % 4 != 2 for i in range(n)]
    book = GrammarBook(json_dir, VOCAB)
    book.bitmask.warm_up(torch.device("cuda"), torch.bfloat16, VOCAB)
    on_gpu = _masked(book, pattern, "cuda", torch.bfloat16)
    assert torch.equal(on_gpu, _masked(GrammarBook(json_dir, VOCAB), pattern))


def test_a_grammar_that_allows_nothing_is_noted_once_and_masked_no_more(json_dir):
    """A regex that matches nothing, and one with nothing after its first character: the
    row is a dead end where its mask allows no token (the step's result ends its request),
    its matcher is not advanced again, and a later step masks it no more."""
    book = GrammarBook(json_dir, VOCAB)
    book.add(0, 3, structured_from_user({"regex": r"[^\s\S]"}), [])
    book.add(1, 3, structured_from_user({"regex": r"a[^\d\D]"}), [])
    book.add(2, 3, SPEC, [])
    rows, epochs, on = np.arange(3), np.full(3, 3), np.array([True, True, True])
    logits = torch.zeros(3, VOCAB)
    book.mask_logits(logits, rows, epochs, on)
    assert book.dead_ends == {(0, 3)}
    step = SimpleNamespace(seq_ids=[10, 11, 12], rows=rows, epochs=epochs)
    (ended,) = book.take_dead_ends(step)
    assert ended == (10, grammar_book.DEAD_END) and book.take_dead_ends(step) == []
    a = _token_ids(book, "a")[0]
    book.accept(rows, epochs, np.array([0, a, _token_ids(book, "{")[0]]), on)
    logits = torch.zeros(3, VOCAB)
    book.mask_logits(logits, rows, epochs, on)
    assert book.take_dead_ends(step) == [(11, grammar_book.DEAD_END)]
    assert (logits[0] == 0).all()  # the first dead end: no longer masked
    assert (logits[2] == 0).sum() < VOCAB  # the live grammar still is


DIES = structured_from_user({"regex": r"Q(R[^\d\D]|S+)"})
"""After "QR" the grammar allows nothing; after "QS", more S or the end."""


def _step(n: int) -> SimpleNamespace:
    """A launched step of entries 0..n-1 (mirror rows 0..n-1, epoch 3, seq ids 10, 11, ..)."""
    return SimpleNamespace(seq_ids=[10 + i for i in range(n)], rows=np.arange(n),
                           epochs=np.full(n, 3))


def test_a_verify_ends_a_request_at_a_dead_position_only_where_it_reaches_it(json_dir):
    """Entries 0 and 1 propose "QR", after which nothing is allowed: entry 0 accepts both
    (its bonus draw comes from the dead mask) and ends; entry 1 rejects "R" and goes on,
    its grammar after "QS". Entry 2's grammar allows nothing from the start: it ends."""
    book = GrammarBook(json_dir, VOCAB)
    q, r, s = _token_ids(book, "QRS")
    for row in (0, 1):
        book.add(row, 3, DIES, [])
    book.add(2, 3, structured_from_user({"regex": r"[^\s\S]"}), [])
    step, on = _step(3), np.array([True, True, True])
    logits = torch.zeros(7, VOCAB)
    book.mask_logits(logits, step.rows, step.epochs, on, [np.array([q, r])] * 2 + [np.array([])])
    assert not (logits[2] == 0).any() and not (logits[5] == 0).any()  # after "QR"
    assert book.dead_ends == set()  # the verify has not said yet
    book.accept(step.rows, step.epochs, np.array([q, r, 0, q, s, 0]), on, np.array([3, 2, 1]))
    assert book.take_dead_ends(step) == [(10, grammar_book.DEAD_END), (12, grammar_book.DEAD_END)]
    logits = torch.zeros(3, VOCAB)
    book.mask_logits(logits, step.rows, step.epochs, on)
    assert (logits[0] == 0).all() and (logits[2] == 0).all()  # ended: masked no more
    assert torch.equal(logits[1] == 0, allowed_after(book.compiled(DIES).result(), [q, s], VOCAB))
    assert book.take_dead_ends(step) == []


def test_a_dead_position_after_draft_proposals_is_left_to_the_verify(json_dir):
    """A draft step masked after the walked proposals "QR" allows nothing; the draft's mask
    does not end the request, the verify's result decides: this one rejects "R", so the
    request goes on."""
    book = GrammarBook(json_dir, VOCAB)
    q, r, s = _token_ids(book, "QRS")
    book.add(0, 3, DIES, [])
    step, on = _step(1), np.array([True])
    for token in (q, r):
        book.mask_logits(torch.zeros(1, VOCAB), step.rows, step.epochs, on)
        book.walk(step.rows, step.epochs, np.array([token]), on)
    dead = torch.zeros(1, VOCAB)
    book.mask_logits(dead, step.rows, step.epochs, on)
    assert not (dead == 0).any() and book.dead_ends == set()
    book.unwind()
    book.mask_logits(torch.zeros(3, VOCAB), step.rows, step.epochs, on, [np.array([q, r])])
    book.accept(step.rows, step.epochs, np.array([q, s]), on, np.array([2]))
    assert book.take_dead_ends(step) == []
