"""The reasoning block a thinking model writes before its answer, `<think> ... </think>`, and
how a constraint on the answer leaves it free.

Two ways a model opens it, named as vLLM's reasoning parsers are:
  * "qwen3": the answer may open with `<think>` (Qwen3 thinks unless the chat template's
    `enable_thinking` is false, which writes an empty block into the prompt instead);
  * "deepseek_r1": the chat template opens the block in the prompt, so the answer starts
    inside it and `</think>` ends it.
A constrained request (structured outputs, tools) of a server with a reasoning parser holds
only the answer after the block to its grammar: the block is any text, then whitespace.
"""

from __future__ import annotations

from typing import Any

START, END = "<think>", "</think>"
OPENS = {"qwen3": False, "deepseek_r1": True}
"""Reasoning parser -> whether the answer starts inside the block (the prompt opened it)."""
PARSERS = tuple(OPENS)


def check_parser(name: str) -> str:
    if name not in OPENS:
        raise ValueError(f"reasoning parser must be one of {', '.join(PARSERS)}, got {name!r}")
    return name


def after_block(grammar: Any, parser: str) -> Any:
    """The xgrammar Grammar that leaves the parser's reasoning block free, then `grammar`."""
    import xgrammar as xgr

    opened = OPENS[check_parser(parser)]
    block = xgr.Grammar.from_structural_tag({"type": "structural_tag", "format": {
        "type": "tag", "begin": "" if opened else START, "content": {"type": "any_text"},
        "end": END}})
    gap = xgr.Grammar.from_ebnf("root ::= [ \\t\\r\\n]*")
    thought = xgr.Grammar.concat(block, gap, grammar)
    return thought if opened else xgr.Grammar.union(thought, grammar)
