"""The operations tests share the pipeline and HTTP helpers of tests/pipeline and
tests/http_api."""

from __future__ import annotations

import sys
from pathlib import Path

for folder in ("pipeline", "http_api"):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / folder))
