"""Per-request sampling and stopping parameters, validated where they are made."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from protocol.codec import struct
from protocol.outcomes import FieldError
from protocol.structured_outputs import (
    StructuredOutputs,
    StructuredOutputsError,
    structured_from_user,
)

MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_STOP_TOKEN_IDS = 256
MAX_ABS_PENALTY = 2.0
MAX_TOP_LOGPROBS = 20
MAX_N = 1024

# Bounds set by where a value is stored. A value that passes here but not its column would
# kill the worker that stores it, and every other request with it.
INT32_MAX = 2**31 - 1
FLOAT32_MAX = 3.4028234663852886e38
FLOAT32_TINY = 1.1754943508222875e-38
"""The smallest normal float32: anything smaller may round to 0 in a float32 column."""

MAX_TOKEN_ID = INT32_MAX
"""Token ids (prompt_token_ids, stop_token_ids) live in the worker mirror's int32 `tokens`
column and the int32 input ids of a batch."""
MAX_TOP_K = INT32_MAX
"""top_k lives in the mirror's int32 `top_k` column and in the batch's int32 host buffer."""
MAX_MAX_TOKENS = INT32_MAX
"""max_tokens bounds a position, and positions and lengths travel in int32 batch buffers."""
MAX_SEED = 2**63 - 1
"""The mirror's `seed` column is int64, with -1 meaning unseeded."""
MIN_TOP_P = FLOAT32_TINY
"""top_p lives in a float32 column: a smaller positive value rounds to 0, which drops every
token and leaves a NaN distribution (token 0 every step). It is refused rather than treated as
greedy, so the request says what it means: temperature=0 is greedy."""
MIN_TEMPERATURE = 1e-6
"""Logits are divided by the temperature in float32: a positive temperature near 0 turns them
into infinities and the distribution into NaN. Below this, ask for greedy (0)."""
MIN_REPETITION_PENALTY = 1e-6
MAX_REPETITION_PENALTY = 1e6
"""Logits are divided or multiplied by the repetition penalty in float32: outside this range
they overflow to infinities (a NaN distribution)."""


class SamplingParamsError(FieldError):
    """A sampling parameter outside its allowed range; `field` names it (as does the message,
    which starts with it)."""


def _bad(field: str, text: str) -> SamplingParamsError:
    """The error for `field`; its message starts with the field's name."""
    return SamplingParamsError(field, f"{field} {text}")


def _finite(name: str, value: int | float) -> None:
    if isinstance(value, int) and abs(value) > FLOAT32_MAX:  # float() would overflow
        value = math.inf
    if not math.isfinite(value) or abs(value) > FLOAT32_MAX:
        raise _bad(name, f"must be a finite float32 number, got {value}")


def check_token_ids(name: str, ids: object, error: type[FieldError]) -> None:
    """Every id an integer (not a bool, not a float) that the worker's int32 columns hold.

    Negative and out-of-vocabulary ids are the tokenizer's to refuse: only it knows the
    vocabulary."""
    if not isinstance(ids, list | tuple):
        raise error(name, f"{name} must be a list of integers, got {type(ids).__name__}")
    for i, t in enumerate(ids):
        if isinstance(t, bool) or not isinstance(t, int):
            raise error(name, f"{name}[{i}] must be an integer token id, got {t!r}")
        if not -MAX_TOKEN_ID <= t <= MAX_TOKEN_ID:
            raise error(name, f"{name}[{i}] = {t} is not a token id (at most {MAX_TOKEN_ID})")


@struct(shared=True)
@dataclass(frozen=True, slots=True)
class SamplingParams:
    temperature: float = 1.0
    """0 means greedy decoding."""
    top_p: float = 1.0
    top_k: int = -1
    """-1 (or 0) turns top-k off."""
    min_p: float = 0.0
    seed: int | None = None
    """Seeds this request's sampling; a seeded request is reproducible, also after preemption."""
    max_tokens: int | None = 16
    """None: until the context is full (the tokenizer turns it into max_model_len - prompt)."""
    ignore_eos: bool = False
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    logprobs: bool = False
    """Return the log-probability of each sampled token."""
    skip_special_tokens: bool = True
    presence_penalty: float = 0.0
    """Subtracted from the logit of every token the request has generated (OpenAI)."""
    frequency_penalty: float = 0.0
    """Subtracted from a token's logit once per time the request has generated it (OpenAI)."""
    repetition_penalty: float = 1.0
    """Tokens in the prompt or the output: positive logits divided by it, negative ones
    multiplied (as in transformers); 1 is off, above 1 discourages repeating."""
    top_logprobs: int = 0
    """With logprobs: also this many of the most likely tokens at each step, with logprobs."""
    include_stop_str_in_output: bool = False
    """A stop string that ends the request stays at the end of its text (vLLM's option)."""
    n: int = 1
    """Completions per prompt (LLM.generate / chat; HTTP has its own `n`). One engine request
    each: an engine request itself is always one completion."""
    structured_outputs: StructuredOutputs | None = None
    """What the output must match (protocol.structured_outputs): given as vLLM spells it,
    {"json": schema} | {"json_object": True} | {"regex": ...} | {"choice": [...]} |
    {"grammar": ebnf}; checked (xgrammar parses it) when the params are made."""

    def __post_init__(self) -> None:
        self._check_structured()
        if isinstance(self.stop, str):  # vLLM and OpenAI take one stop string as it is
            object.__setattr__(self, "stop", [self.stop])
        for name in ("stop", "stop_token_ids"):  # None, as OpenAI's `"stop": null`: none
            if getattr(self, name) is None:
                object.__setattr__(self, name, [])
        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                     "repetition_penalty"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise _bad(name, f"must be a number, got {value!r}")
            _finite(name, value)
        for name in ("top_k", "max_tokens", "top_logprobs", "n"):
            value = getattr(self, name)
            if name == "max_tokens" and value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int):
                raise _bad(name, f"must be an integer, got {value!r}")
        for name in ("ignore_eos", "logprobs", "skip_special_tokens",
                     "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                hint = (" (for the N most likely tokens too: logprobs=True, top_logprobs=N)"
                        if name == "logprobs" else "")
                raise _bad(name, f"must be True or False, got {getattr(self, name)!r}{hint}")
        if self.temperature < 0:
            raise _bad("temperature", f"must be >= 0, got {self.temperature}")
        if 0 < self.temperature < MIN_TEMPERATURE:
            raise _bad("temperature",
                       f"must be 0 (greedy) or >= {MIN_TEMPERATURE}, got {self.temperature}")
        if not MIN_TOP_P <= self.top_p <= 1:
            raise _bad("top_p", f"must be in [{MIN_TOP_P:.4g}, 1] (use temperature=0 for "
                       f"greedy), got {self.top_p}")
        if not -1 <= self.top_k <= MAX_TOP_K:
            raise _bad("top_k", f"must be -1 or 0 (off) or in [1, {MAX_TOP_K}], got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            raise _bad("min_p", f"must be in [0, 1], got {self.min_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -MAX_ABS_PENALTY <= getattr(self, name) <= MAX_ABS_PENALTY:
                raise _bad(name, f"must be in [-{MAX_ABS_PENALTY}, {MAX_ABS_PENALTY}], "
                           f"got {getattr(self, name)}")
        if not MIN_REPETITION_PENALTY <= self.repetition_penalty <= MAX_REPETITION_PENALTY:
            raise _bad("repetition_penalty", f"must be in [{MIN_REPETITION_PENALTY}, "
                       f"{MAX_REPETITION_PENALTY}], got {self.repetition_penalty}")
        if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise _bad("top_logprobs",
                       f"must be in [0, {MAX_TOP_LOGPROBS}], got {self.top_logprobs}")
        if not 1 <= self.n <= MAX_N:
            raise _bad("n", f"must be in [1, {MAX_N}], got {self.n}")
        if self.top_logprobs and not self.logprobs:
            raise _bad("top_logprobs", "needs logprobs=True")
        if self.max_tokens is not None and not 1 <= self.max_tokens <= MAX_MAX_TOKENS:
            raise _bad("max_tokens", f"must be in [1, {MAX_MAX_TOKENS}], got {self.max_tokens}")
        if self.seed is not None and (
            isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0
            or self.seed > MAX_SEED
        ):
            raise _bad("seed", f"must be an integer in [0, 2**63), got {self.seed!r}")
        self._check_stops()

    def _check_structured(self) -> None:
        value = self.structured_outputs
        if value is None:
            return
        if not isinstance(value, StructuredOutputs):  # a decoded struct had its own check
            try:
                value = structured_from_user(value)
            except StructuredOutputsError as exc:
                raise SamplingParamsError(exc.field, str(exc)) from None
            object.__setattr__(self, "structured_outputs", value)
        if self.ignore_eos is True:
            raise _bad("ignore_eos", "must be False with structured_outputs (the grammar ends "
                       "the output with an EOS token)")

    def _check_stops(self) -> None:
        if not isinstance(self.stop, list | tuple):
            raise _bad("stop", "must be a list of strings")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise _bad("stop", f"accepts at most {MAX_STOP_STRINGS} strings")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise _bad("stop", f"strings must be non-empty strings, got {s!r}")
            if len(s) > MAX_STOP_STRING_CHARS:
                raise _bad("stop", f"strings must be at most {MAX_STOP_STRING_CHARS} characters")
        if not isinstance(self.stop_token_ids, list | tuple):
            raise _bad("stop_token_ids", "must be a list of integers")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise _bad("stop_token_ids", f"accepts at most {MAX_STOP_TOKEN_IDS} ids")
        for t in self.stop_token_ids:
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t <= MAX_TOKEN_ID:
                raise _bad("stop_token_ids",
                           f"must be integers in [0, {MAX_TOKEN_ID}], got {t!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def uses_penalties(self) -> bool:
        return (self.presence_penalty != 0 or self.frequency_penalty != 0
                or self.repetition_penalty != 1)


SamplingParamsLike = SamplingParams | Mapping[str, Any]
"""What the LLM and the clients take for a request's parameters."""


def as_sampling_params(value: Any, where: str) -> SamplingParams:
    """`value` as SamplingParams: as it is, or a dict of its fields (as the LLM and the clients
    take them). A TypeError names `where` (the argument) for anything else or an unknown
    field; a value out of range is a SamplingParamsError naming its field."""
    if isinstance(value, SamplingParams):
        return value
    if isinstance(value, Mapping):
        try:
            return SamplingParams(**value)
        except TypeError as exc:  # an unknown field
            raise TypeError(f"{where}: {exc}") from None
    raise TypeError(f"{where} must be a SamplingParams (or a dict of its fields), got "
                    f"{type(value).__name__}")


def choice_params(params: SamplingParams, n: int) -> list[SamplingParams]:
    """One engine request's params for each of n completions of a prompt. A seeded request
    seeds completion j with seed + j, so the n differ and the whole answer still reproduces."""
    if n == 1:
        return [dataclasses.replace(params, n=1)] if params.n != 1 else [params]
    return [dataclasses.replace(params, n=1, seed=None if params.seed is None
                                else (params.seed + j) % (MAX_SEED + 1)) for j in range(n)]
