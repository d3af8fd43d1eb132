"""Start a whole pipeline on the embedded SmolLM2 model and stream a few chat answers.

    python scripts/quickstart.py [--model DIR] [--device cpu|cuda]
"""

from __future__ import annotations

import argparse
import sys
import time

from frontend import Client, SamplingParams
from frontend.engine.config import EngineConfig
from frontend.engine.pipeline import Pipeline

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Give me three tips for learning to code.",
]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--device", choices=("cpu", "cuda"), default=None)
    parser.add_argument("--max-tokens", type=int, default=96)
    args = parser.parse_args()

    # No periodic stats line: on stderr it would land in the middle of a streamed answer.
    config = EngineConfig(model=args.model, device=args.device, max_model_len=2048,
                          log_stats_interval=0)
    print("starting the pipeline (the first run converts the model once)...", flush=True)
    with Pipeline(config) as pipeline, Client(pipeline.address) as client:
        print(f"{config.model_name} on {config.resolved_device}, "
              f"clients connect to {pipeline.address}\n", flush=True)
        params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
        for question in QUESTIONS:
            print(f">>> {question}\n", flush=True)
            start = time.perf_counter()
            tokens = 0
            for delta in client.stream(messages=[{"role": "user", "content": question}],
                                       params=params):
                tokens += len(delta.token_ids)
                sys.stdout.write(delta.text)
                sys.stdout.flush()
            elapsed = time.perf_counter() - start
            print(f"\n\n[{tokens} tokens in {elapsed:.2f} s]\n", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
