"""Every third-party module the tests import is declared in pyproject.toml.

A fresh `pip install -e '.[test]'` must be enough to collect the suite: a module that is
only present because some other package happened to pull it in (pydantic through fastapi,
numpy through an extra) breaks collection on the next machine. Plain imports must come from
the core dependencies or the `test` extra; a module the tests only reach through
`pytest.importorskip` may come from any extra (the test skips where it is absent).
"""

from __future__ import annotations

import ast
import functools
import re
import sys
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]
TESTS = ROOT / "tests"

IMPORT_TO_DIST = {
    "zmq": "pyzmq",
    "yaml": "pyyaml",
    "PIL": "pillow",
    "sklearn": "scikit-learn",
    "cv2": "opencv-python",
    "attr": "attrs",
    "dateutil": "python-dateutil",
    "google": "protobuf",
    "flash_attn": "flash-attn",
    "pytest_timeout": "pytest-timeout",
}
"""Import names whose distribution is named differently (beyond case and `-`/`_`)."""


@dataclass(frozen=True)
class ScannedImport:
    module: str
    where: str
    optional: bool
    """Reached through pytest.importorskip: the test skips where the module is absent."""


def _normalize(dist: str) -> str:
    return re.sub(r"[-_.]+", "-", dist).lower()


def _requirement_name(requirement: str) -> str:
    return _normalize(re.split(r"[\s<>=!~;\[(@]", requirement.strip(), maxsplit=1)[0])


def _declared() -> tuple[set[str], set[str]]:
    """(dists a plain test import may use, dists an importorskip may use)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project.get("optional-dependencies", {})
    required = {_requirement_name(r) for r in project["dependencies"] + extras.get("test", [])}
    anywhere = required | {_requirement_name(r) for reqs in extras.values() for r in reqs}
    return required, anywhere


def _local_modules() -> set[str]:
    """Names the tests import from the repository itself: its packages, the helpers beside
    the tests (each test folder is on sys.path) and the scripts' package."""
    names = {"tests", "scripts"}
    for folder in (ROOT, TESTS, ROOT / "scripts"):
        names |= {p.name for p in folder.iterdir() if (p / "__init__.py").exists()}
    names |= {p.stem for p in TESTS.rglob("*.py")}
    names |= {p.stem for p in (ROOT / "scripts").glob("*.py")}
    return names


def _imports_of(path: Path) -> list[ScannedImport]:
    tree = ast.parse(path.read_text(), filename=str(path))
    where = str(path.relative_to(ROOT))
    plain, skipped = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            plain |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            plain.add(node.module.split(".")[0])
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and node.func.attr == "importorskip" and node.args
              and isinstance(node.args[0], ast.Constant)
              and isinstance(node.args[0].value, str)):
            skipped.add(node.args[0].value.split(".")[0])
    # A file that importorskips a module may import from it plainly afterwards.
    return ([ScannedImport(m, where, False) for m in sorted(plain - skipped)]
            + [ScannedImport(m, where, True) for m in sorted(skipped)])


@functools.cache
def _installed_providers() -> dict[str, list[str]]:
    return metadata.packages_distributions()


def _dists_for(module: str) -> set[str]:
    """The distributions that may provide `module`: the known renames, the module's own
    name, and what the installed packages' metadata says provides it."""
    dists = {_normalize(IMPORT_TO_DIST.get(module, module))}
    dists |= {_normalize(d) for d in _installed_providers().get(module, [])}
    return dists


def third_party_test_imports() -> list[ScannedImport]:
    local = _local_modules()
    return [imp for path in sorted(TESTS.rglob("*.py")) for imp in _imports_of(path)
            if imp.module not in sys.stdlib_module_names and imp.module not in local
            and imp.module != "__future__"]


def test_every_test_import_is_declared():
    required, anywhere = _declared()
    missing = sorted({
        f"{imp.module} ({imp.where}{', via importorskip' if imp.optional else ''})"
        for imp in third_party_test_imports()
        if not _dists_for(imp.module) & (anywhere if imp.optional else required)
    })
    assert not missing, (
        "test imports not declared in pyproject.toml (add the distribution to the core "
        "dependencies or the `test` extra): " + "; ".join(missing))


def test_the_scan_sees_known_imports():
    """The scan itself works: it finds imports the suite is known to make, both kinds."""
    imports = third_party_test_imports()
    plain = {imp.module for imp in imports if not imp.optional}
    optional = {imp.module for imp in imports if imp.optional}
    assert {"torch", "zmq", "pytest"} <= plain
    assert "ray" in optional
    assert not {"frontend", "tiny_models", "benchlib"} & plain
    assert {"pyzmq"} <= _dists_for("zmq")


def test_an_undeclared_import_is_reported():
    """A module no distribution of pyproject provides is flagged, a renamed one is not."""
    required, _ = _declared()
    assert not _dists_for("surely_not_a_dependency_xyz") & required
    assert _dists_for("zmq") & required
