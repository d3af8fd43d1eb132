"""Fuzz the OpenAI request schema and everything a body goes through before the engine.

Every body, arbitrary JSON or nearly a valid request, ends as a request the tokenizer accepts
off the wire or as a 4xx naming the field; never another exception. The path is the server's:
JSON parsing, the pydantic models, the mapping onto SamplingParams, the client's encoding of
the GenerateRequest, the tokenizer's decoding of it and RequestValidator.

NANOPIPE_FUZZ_EXAMPLES sets the number of bodies (default 2000, under a minute); the full run
is NANOPIPE_FUZZ_EXAMPLES=100000.
"""

from __future__ import annotations

import json
import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from frontend.actors.request_validation import InvalidRequest, RequestValidator
from frontend.client.frames import make_request
from frontend.openai_server.errors import ApiError, params_error, validation_error
from frontend.openai_server.schema import ChatCompletionRequest, CompletionRequest
from protocol import Decoder, GenerateRequest, SamplingParamsError

pytestmark = pytest.mark.slow
EXAMPLES = int(os.environ.get("NANOPIPE_FUZZ_EXAMPLES", "2000"))
VOCAB, MAX_MODEL_LEN = 1000, 256


class CharTokenizer:
    """One token per character: enough for RequestValidator's paths."""

    chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) % VOCAB for c in text]

    def apply_chat_template(self, conversation, add_generation_prompt, tokenize):
        return "".join(m["content"] for m in conversation)


VALIDATOR = RequestValidator(CharTokenizer(), VOCAB)
DECODER = Decoder(GenerateRequest)

# ------------------------------------------------------------------ bodies

EDGE_INTS = st.sampled_from([0, 1, -1, 2**31 - 1, 2**31, 2**32, 2**53 + 1, 2**63 - 1, 2**63,
                             2**64, -(2**63) - 1, 10**30, 10**400])
EDGE_FLOATS = st.sampled_from([0.0, -0.0, 1e-300, 5e-324, 1e-39, 1e-7, 1e30, 1e39, 1e308,
                               float("inf"), float("-inf"), float("nan"), 0.5, 1.0, 2.0])
TEXT = st.text(st.characters(codec=None, exclude_categories=()), max_size=12)
"""Any code point, lone surrogates included (JSON can carry them as escapes)."""
SCALARS = (st.none() | st.booleans() | st.integers() | EDGE_INTS | st.floats() | EDGE_FLOATS
           | TEXT)
JSON = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=3)
                    | st.dictionaries(TEXT, inner, max_size=3), max_leaves=6)

ROLES = st.sampled_from(["system", "developer", "user", "assistant", "tool"])
NUMBER = st.integers(-3, 40) | EDGE_INTS | st.floats(-3, 3) | EDGE_FLOATS
WILD_IDS = st.lists(st.integers(-2, VOCAB + 5) | EDGE_INTS | st.booleans() | EDGE_FLOATS,
                    max_size=6)
OK_TEXT = st.text(max_size=12)
OK_IDS = st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=6)

# Each field as a valid value and as a wild one; a near-valid body is valid but for a few.
SAMPLING = {
    "model": (st.none(), TEXT | JSON),
    "max_tokens": (st.integers(1, 40) | st.none(), NUMBER),
    "temperature": (st.floats(0, 2), NUMBER), "top_p": (st.floats(0.01, 1), NUMBER),
    "top_k": (st.integers(-1, 50), NUMBER), "min_p": (st.floats(0, 1), NUMBER),
    "seed": (st.integers(0, 2**63 - 1) | st.none(), NUMBER),
    "stop": (OK_TEXT.filter(bool) | st.lists(OK_TEXT.filter(bool), max_size=3),
             TEXT | st.lists(TEXT, max_size=20) | JSON),
    "stop_token_ids": (st.lists(st.integers(0, VOCAB - 1), max_size=3), WILD_IDS | JSON),
    "ignore_eos": (st.booleans(), JSON), "skip_special_tokens": (st.booleans(), JSON),
    "stream": (st.booleans(), JSON),
    "stream_options": (st.none(), st.fixed_dictionaries({}, optional={
        "include_usage": st.booleans()}) | JSON),
    "n": (st.integers(1, 3) | st.none(), NUMBER),
    "presence_penalty": (st.floats(-2, 2), NUMBER),
    "frequency_penalty": (st.floats(-2, 2), NUMBER),
    "repetition_penalty": (st.floats(0.5, 2), NUMBER),
    "logit_bias": (st.none(), st.dictionaries(TEXT, NUMBER, max_size=2)),
    "user": (OK_TEXT, JSON),
}
COMPLETION_FIELDS = {
    **SAMPLING,
    "prompt": (OK_TEXT.filter(str.strip) | OK_IDS | st.lists(OK_TEXT.filter(str.strip),
                                                             min_size=1, max_size=1)
               | st.lists(OK_IDS, min_size=1, max_size=1),
               TEXT | WILD_IDS | st.lists(TEXT, max_size=2) | st.lists(WILD_IDS, max_size=2)
               | JSON),
    "logprobs": (st.none() | st.booleans() | st.integers(0, 5), NUMBER | JSON),
    "echo": (st.just(False), JSON), "best_of": (st.none() | st.just(1), NUMBER),
    "suffix": (st.none(), TEXT | JSON),
}
MESSAGE = st.fixed_dictionaries(
    {"role": ROLES}, optional={"content": OK_TEXT | st.lists(st.fixed_dictionaries(
        {"type": st.just("text"), "text": OK_TEXT}), max_size=2)})
WILD_MESSAGE = st.fixed_dictionaries(
    {"role": ROLES | JSON},
    optional={"content": TEXT | st.lists(st.fixed_dictionaries(
        {"type": st.just("text") | JSON, "text": TEXT | JSON}), max_size=3) | JSON})
CHAT_FIELDS = {
    **SAMPLING,
    "messages": (st.lists(MESSAGE, min_size=1, max_size=3),
                 st.lists(WILD_MESSAGE | MESSAGE, max_size=3) | JSON),
    "max_completion_tokens": (st.integers(1, 40) | st.none(), NUMBER),
    "logprobs": (st.booleans(), JSON), "top_logprobs": (st.none(), NUMBER),
    "tools": (st.none(), JSON), "tool_choice": (st.none(), JSON),
    "response_format": (st.none(), JSON),
}


@st.composite
def near_valid(draw, fields: dict, required: str) -> dict:
    """A valid body (a few optional fields set), then up to two fields made wild."""
    names = sorted(fields)
    chosen = draw(st.lists(st.sampled_from(names), max_size=5, unique=True))
    body = {name: draw(fields[name][0]) for name in [required, *chosen]}
    for name in draw(st.lists(st.sampled_from(names), max_size=2, unique=True)):
        body[name] = draw(fields[name][1])
    if draw(st.integers(0, 9)) == 0:
        del body[required]
    return body


COMPLETION = near_valid(COMPLETION_FIELDS, "prompt")
CHAT = near_valid(CHAT_FIELDS, "messages")


def _encoded(obj, mangle: int) -> bytes:
    body = json.dumps(obj).encode()  # escapes lone surrogates, as clients do
    if mangle == 1:
        body = body[: len(body) // 2]  # cut short
    elif mangle == 2:
        body = body.replace(b":", b"", 1)
    return body


BODIES = st.one_of(
    st.tuples(st.sampled_from([CompletionRequest, ChatCompletionRequest]),
              JSON.map(lambda v: json.dumps(v).encode())),
    st.tuples(st.just(CompletionRequest),
              st.builds(_encoded, COMPLETION, st.sampled_from([0, 0, 0, 0, 1, 2]))),
    st.tuples(st.just(ChatCompletionRequest),
              st.builds(_encoded, CHAT, st.sampled_from([0, 0, 0, 0, 1, 2]))),
)

# ------------------------------------------------------------------ the path


def handle(model: type, body: bytes) -> bytes | None:
    """The frame the client would send, or None when the server answers 4xx; any other
    exception is a bug."""
    try:
        try:
            obj = json.loads(body)
        except ValueError:  # FastAPI answers a body that is no JSON with 400
            return None
        try:
            req = model.model_validate(obj)
        except ValidationError as exc:
            raise validation_error(list(exc.errors())) from None
        params = req.choice_params(req.sampling_params())
        prompts = (req.prompt_kwargs() if isinstance(req, CompletionRequest)
                   else [{"messages": req.wire_messages()}])
    except ApiError as exc:
        assert 400 <= exc.status < 500, exc.message
        assert exc.param or not isinstance(obj, dict), exc.message
        return None
    except SamplingParamsError as exc:
        assert params_error(exc).param, exc
        return None
    frames = [make_request("r", kwargs.get("prompt"), kwargs.get("prompt_token_ids"),
                           kwargs.get("messages"), p, False) for kwargs in prompts for p in params]
    for frame in frames:
        decoded = DECODER.decode(frame)  # the tokenizer must accept what the server sends
        try:
            VALIDATOR.prompt_token_ids(decoded)
        except InvalidRequest as exc:
            assert exc.field, exc  # a tokenizer refusal names its field too
    return frames[0]


@settings(max_examples=EXAMPLES, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                 HealthCheck.filter_too_much])
@given(BODIES)
def test_every_body_is_a_request_or_a_4xx_naming_its_field(case):
    model, body = case
    handle(model, body)


def test_the_fuzzer_reaches_valid_requests_too():
    """The near-valid bodies are near enough: a good share get through to the engine."""
    accepted = []

    # About a fifth get through (58 to 68 of 300 in runs so far: string hashing still varies
    # a derandomized run's draws); asking for a tenth checks the same property with room.
    @settings(max_examples=300, deadline=None, database=None, derandomize=True,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(st.builds(_encoded, COMPLETION, st.just(0)))
    def run(body):
        accepted.append(handle(CompletionRequest, body) is not None)

    run()
    assert sum(accepted) > len(accepted) // 10
