"""The launcher's --log-level applies to nanopipe's loggers, not to every library's."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = """
import logging
from frontend.engine.log_config import configure_logging
configure_logging({level!r})
logging.getLogger("torch._subclasses.fake_tensor").info("library info")
logging.getLogger("torch").warning("library warning")
logging.getLogger("nanopipe.launcher").info("our info")
logging.getLogger("nanopipe.router").debug("our debug")
"""


@pytest.mark.parametrize("level,ours", [("info", ["our info"]),
                                        ("debug", ["our info", "our debug"]),
                                        ("warning", [])])
def test_the_level_is_nanopipes_and_libraries_say_only_warnings(level, ours):
    err = subprocess.run([sys.executable, "-c", SCRIPT.format(level=level)], cwd=ROOT,
                         capture_output=True, text=True, check=True).stderr
    said = [line.split(": ", 1)[1] for line in err.splitlines()]
    assert said == ["library warning", *ours]
