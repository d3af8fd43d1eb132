"""Print what a StepPlan and its StepResult cost on the wire and to encode + decode.

    python scripts/bench_protocol.py [--num-seqs 256] [--k 4] [--acceptance 0.8]

Bytes per continuing decode sequence are measured as the growth of an encoded plan per
sequence, with realistic sequence ids (large, as after days of serving) and a new block
every 16 steps (block size 16, the worst case for the CPU default). With speculation the plan
carries each entry's cap K (num_spec) and the result each entry's 1 + accepted tokens, flat,
with num_tokens and num_proposed: accepted counts follow per-token acceptance --acceptance
(each proposal accepted with that probability while the ones before it were), token ids are
drawn from a --vocab vocabulary (ids above 65,535 take 5 bytes in msgpack, 3 below).
"""

from __future__ import annotations

import argparse
import random
import time

from protocol import (
    AddRequest,
    CachedSequences,
    Decoder,
    NewSequence,
    SamplingParams,
    StepPlan,
    StepResult,
    TokenDeltas,
    encode,
)

FIRST_ID = 1_000_000


def decode_plan(num_seqs: int, first_id: int = FIRST_ID, step: int = 0, k: int = 0) -> StepPlan:
    ids = list(range(first_id, first_id + num_seqs))
    # A speculating entry reserves up to K more slots, so it crosses a block boundary more often.
    new_blocks = [[7_000 + i] if (i + step) % max(1, 16 // (1 + k)) == 0 else []
                  for i in range(num_seqs)]
    return StepPlan(step, [], [], CachedSequences(ids, [1] * num_seqs, new_blocks,
                                                  [k] * num_seqs if k else []))


def decode_result(num_seqs: int, vocab: int, k: int = 0, acceptance: float = 0.0,
                  proposed: float = 1.0, seed: int = 0) -> StepResult:
    """A result for decode_plan: entry i verified num_proposed[i] (K, or 0 when its n-gram
    was not found, with probability 1 - proposed) and produced 1 + accepted tokens."""
    rng = random.Random(seed)
    ids = list(range(FIRST_ID, FIRST_ID + num_seqs))
    if not k:
        return StepResult(0, ids, [rng.randrange(vocab) for _ in ids], None)
    num_tokens, num_proposed = [], []
    for _ in ids:
        v = k if rng.random() < proposed else 0
        a = 0
        while a < v and rng.random() < acceptance:
            a += 1
        num_tokens.append(1 + a)
        num_proposed.append(v)
    tokens = [rng.randrange(vocab) for _ in range(sum(num_tokens))]
    return StepResult(0, ids, tokens, None, num_tokens=num_tokens, num_proposed=num_proposed)


def per_seq_bytes(make, num_seqs: int) -> float:
    """Growth of the encoded message per sequence."""
    return (len(encode(make(num_seqs))) - len(encode(make(0)))) / num_seqs


def prefill_plan(num_seqs: int, prompt_len: int) -> StepPlan:
    params = SamplingParams(temperature=0.6, max_tokens=512)
    seqs = [
        NewSequence(i, list(range(prompt_len)), prompt_len, 0, prompt_len,
                    list(range(i * 64, i * 64 + prompt_len // 16 + 1)), params)
        for i in range(num_seqs)
    ]
    return StepPlan(0, [], seqs, CachedSequences([], [], []))


def decode_deltas(num_seqs: int, vocab: int) -> TokenDeltas:
    """A decode step's deltas to the detokenizer: one token per request, none finished."""
    rng = random.Random(0)
    return TokenDeltas(0, list(range(FIRST_ID, FIRST_ID + num_seqs)),
                       [[rng.randrange(vocab)] for _ in range(num_seqs)], [None] * num_seqs,
                       [None] * num_seqs, None)


def time_round_trip(plan: StepPlan | StepResult | AddRequest | TokenDeltas, repeats: int,
                    make=None) -> tuple[float, float]:
    """Seconds to encode and to decode `plan`; with `make`, encoding times building the
    message too."""
    decoder = Decoder(type(plan))
    frame = encode(plan)
    start = time.perf_counter()
    for _ in range(repeats):
        frame = encode(plan if make is None else make())
    encode_s = (time.perf_counter() - start) / repeats
    start = time.perf_counter()
    for _ in range(repeats):
        decoder.decode(frame)
    decode_s = (time.perf_counter() - start) / repeats
    return encode_s, decode_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-seqs", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=2000)
    parser.add_argument("--k", type=int, default=4, help="speculation: proposals per entry")
    parser.add_argument("--acceptance", type=float, default=0.8,
                        help="speculation: per-token acceptance rate")
    parser.add_argument("--vocab", type=int, default=151_936,
                        help="token ids drawn below this (Qwen3's 151,936; SmolLM2 49,152)")
    args = parser.parse_args()
    n = args.num_seqs

    empty = len(encode(decode_plan(0)))
    full = len(encode(decode_plan(n)))
    per_seq = (full - empty) / n
    print(f"StepPlan with {n} continuing decode sequences: {full} bytes")
    print(f"bytes per continuing decode sequence: {per_seq:.2f} (goal <= 16)")
    enc, dec = time_round_trip(decode_plan(n), args.repeats)
    print(f"{n}-sequence decode plan: encode {enc * 1e6:.1f} us, decode {dec * 1e6:.1f} us")
    enc, dec = time_round_trip(decode_deltas(n, args.vocab), args.repeats)
    print(f"{n}-sequence decode step's TokenDeltas: encode {enc * 1e6:.1f} us, "
          f"decode {dec * 1e6:.1f} us")
    big = prefill_plan(n, 512)
    enc, dec = time_round_trip(big, max(1, args.repeats // 100))
    print(f"{n}-sequence prefill plan ({len(encode(big)) / 1e6:.2f} MB): "
          f"encode {enc * 1e3:.2f} ms, decode {dec * 1e3:.2f} ms")
    # The tokenizer builds AddRequest from its token list, so the list's packing is timed too.
    rng = random.Random(0)
    prompt = [rng.randrange(args.vocab) for _ in range(1024)]
    enc, dec = time_round_trip(AddRequest(1, prompt, SamplingParams(), [2]), args.repeats,
                               make=lambda: AddRequest(1, prompt, SamplingParams(), [2]))
    print(f"1,024-token AddRequest (built from a token list): encode {enc * 1e6:.1f} us, "
          f"decode {dec * 1e6:.1f} us")
    speculation_bytes(args)


def speculation_bytes(args) -> None:
    """Plan + result bytes per decoding sequence and per token produced, with and without
    speculation (K proposals each; all found, or half of the n-grams not found)."""
    n, k, vocab = args.num_seqs, args.k, args.vocab
    print(f"per decoding sequence, {n} sequences, token ids below {vocab:,}:")
    cases = [("no speculation", 0, 0.0, 1.0),
             (f"K={k}, acceptance {args.acceptance:.0%}", k, args.acceptance, 1.0),
             (f"K={k}, acceptance {args.acceptance:.0%}, half the n-grams not found", k,
              args.acceptance, 0.5),
             (f"K={k}, no n-gram found (num_proposed None)", k, 0.0, 0.0)]
    for name, kk, acc, found in cases:
        plan = per_seq_bytes(lambda m, kk=kk: decode_plan(m, k=kk), n)
        result = per_seq_bytes(lambda m, kk=kk, acc=acc, found=found:
                               decode_result(m, vocab, kk, acc, found), n)
        sample = decode_result(n, vocab, kk, acc, found)
        produced = len(sample.token_ids) / n
        print(f"  {name:>48}: plan {plan:5.2f} + result {result:5.2f} = "
              f"{plan + result:5.2f} bytes per step, {(plan + result) / produced:5.2f} per "
              f"token produced ({produced:.2f} tokens per step)")
    enc, dec = time_round_trip(decode_result(n, vocab, k, args.acceptance), args.repeats // 4)
    print(f"{n}-sequence speculative result: encode {enc * 1e6:.1f} us, "
          f"decode {dec * 1e6:.1f} us")


if __name__ == "__main__":
    main()
