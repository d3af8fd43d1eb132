"""Print what a StepPlan costs on the wire and to encode + decode.

    python scripts/bench_protocol.py [--num-seqs 256]

Bytes per continuing decode sequence are measured as the growth of an encoded plan per
sequence, with realistic sequence ids (large, as after days of serving) and a new block
every 16 steps (block size 16, the worst case for the CPU default).
"""

from __future__ import annotations

import argparse
import time

from protocol import CachedSequences, Decoder, NewSequence, SamplingParams, StepPlan, encode


def decode_plan(num_seqs: int, first_id: int = 1_000_000, step: int = 0) -> StepPlan:
    ids = list(range(first_id, first_id + num_seqs))
    new_blocks = [[7_000 + i] if (i + step) % 16 == 0 else [] for i in range(num_seqs)]
    return StepPlan(step, [], [], CachedSequences(ids, [1] * num_seqs, new_blocks))


def prefill_plan(num_seqs: int, prompt_len: int) -> StepPlan:
    params = SamplingParams(temperature=0.6, max_tokens=512)
    seqs = [
        NewSequence(i, list(range(prompt_len)), prompt_len, 0, prompt_len,
                    list(range(i * 64, i * 64 + prompt_len // 16 + 1)), params)
        for i in range(num_seqs)
    ]
    return StepPlan(0, [], seqs, CachedSequences([], [], []))


def time_round_trip(plan: StepPlan, repeats: int) -> tuple[float, float]:
    decoder = Decoder(StepPlan)
    frame = encode(plan)
    start = time.perf_counter()
    for _ in range(repeats):
        frame = encode(plan)
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
    args = parser.parse_args()
    n = args.num_seqs

    empty = len(encode(decode_plan(0)))
    full = len(encode(decode_plan(n)))
    per_seq = (full - empty) / n
    print(f"StepPlan with {n} continuing decode sequences: {full} bytes")
    print(f"bytes per continuing decode sequence: {per_seq:.2f} (goal <= 16)")
    enc, dec = time_round_trip(decode_plan(n), args.repeats)
    print(f"{n}-sequence decode plan: encode {enc * 1e6:.1f} us, decode {dec * 1e6:.1f} us")
    big = prefill_plan(n, 512)
    enc, dec = time_round_trip(big, max(1, args.repeats // 100))
    print(f"{n}-sequence prefill plan ({len(encode(big)) / 1e6:.2f} MB): "
          f"encode {enc * 1e3:.2f} ms, decode {dec * 1e3:.2f} ms")


if __name__ == "__main__":
    main()
