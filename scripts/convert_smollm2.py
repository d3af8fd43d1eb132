"""Convert the packaged SmolLM2-135M-Instruct GGUF into a Hugging Face directory.

    python scripts/convert_smollm2.py                       # into the nanopipe cache
    python scripts/convert_smollm2.py --cache-dir DIR       # into DIR/smollm2-135m-instruct
    python scripts/convert_smollm2.py --gguf F.gguf --out D # any llama GGUF into D

Prints the directory. The engine converts on first use anyway; this just does it ahead of time.
"""

from __future__ import annotations

import argparse

from frontend.embedded_model import convert_gguf, default_model_dir


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--cache-dir", help="cache root (default: $NANOPIPE_CACHE or ~/.cache/nanopipe)"
    )
    parser.add_argument(
        "--gguf", help="convert this GGUF instead of the packaged one (needs --out)"
    )
    parser.add_argument("--out", help="output directory for --gguf")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    args = parser.parse_args()
    if (args.gguf is None) != (args.out is None):
        parser.error("--gguf and --out go together")
    if args.gguf is not None:
        print(convert_gguf(args.gguf, args.out, progress=not args.quiet))
    else:
        print(default_model_dir(args.cache_dir, progress=not args.quiet))


if __name__ == "__main__":
    main()
