"""Compiled grammars of rank 0's GrammarBook, by spec: compiling one (the token masks of a
JSON schema over the whole vocabulary) takes milliseconds to seconds, so it runs on a thread
of its own, and the result is cached (bounded, least recently used first out)."""

from __future__ import annotations

from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from protocol import model_config as hf
from protocol.structured_outputs import StructuredOutputs, build_grammar

CACHE_SIZE = 128
"""Compiled grammars kept (by spec); the least recently used beyond this are dropped."""
COMPILE_THREADS = 4
"""xgrammar's own threads per compile (the token-mask precomputation is parallel)."""


def _tokenizer_info(model_dir: str, vocab_size: int) -> Any:
    import xgrammar as xgr
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    eos = set(hf.eos_token_ids(hf.read_generation_config(model_dir)))
    if hf.has_model_config(model_dir):
        eos.update(hf.eos_token_ids(hf.read_model_config(model_dir)))
    if tokenizer.eos_token_id is not None:
        eos.add(tokenizer.eos_token_id)
    return xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                              stop_token_ids=sorted(eos))


class GrammarCompiles:
    def __init__(self, model_dir: str, vocab_size: int, cache_size: int = CACHE_SIZE) -> None:
        self.model_dir = model_dir
        self.vocab_size = vocab_size
        self.cache_size = cache_size
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="grammar-compile")
        self._compiler: Future | None = None
        """Made with the first compile: an engine that never sees a grammar never loads it."""
        self._compiled: OrderedDict[tuple[str, str], Future] = OrderedDict()

    def _make_compiler(self) -> Any:
        import xgrammar as xgr

        info = _tokenizer_info(self.model_dir, self.vocab_size)
        return xgr.GrammarCompiler(info, max_threads=COMPILE_THREADS, cache_enabled=False)

    def _compile(self, spec: StructuredOutputs) -> Any:
        return self._compiler.result().compile_grammar(build_grammar(spec))

    def compiled(self, spec: StructuredOutputs) -> Future:
        """The compile of `spec`, started now or earlier (cached by spec)."""
        future = self._compiled.get(spec.key)
        if future is not None:
            self._compiled.move_to_end(spec.key)
            return future
        if self._compiler is None:
            self._compiler = self._pool.submit(self._make_compiler)
        future = self._pool.submit(self._compile, spec)
        self._compiled[spec.key] = future
        while len(self._compiled) > self.cache_size:
            self._compiled.popitem(last=False)
        return future
