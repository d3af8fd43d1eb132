"""Write a copy of a Hugging Face model directory that keeps only its first N decoder layers
(a draft model for `--speculative draft`; see frontend.bench.common/truncate.py).

    python scripts/truncate_model.py SRC_DIR OUT_DIR --layers 4
"""

from __future__ import annotations

import argparse

from frontend.bench.common import truncate_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("src")
    ap.add_argument("out")
    ap.add_argument("--layers", type=int, required=True)
    args = ap.parse_args()
    print(truncate_model(args.src, args.out, args.layers))


if __name__ == "__main__":
    main()
