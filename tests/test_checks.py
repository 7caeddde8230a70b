"""The static checks of README "Checks" see what they are meant to see.

- ``asyncckpt/__init__.py`` exports its names lazily (``__getattr__``); a
  ``TYPE_CHECKING`` block names the same objects for type checkers. Without it every
  ``asyncckpt.X`` is ``Any`` to mypy, and nothing reached through it is checked.
- mypy, as configured in pyproject.toml, flags an attribute that does not exist in an
  unannotated test function: the shape of issue 26's defect 5 (``tests/test_cuda.py``
  read ``saver.stager`` after the rename to ``pool``; CI has no GPU, so the test never
  ran and nobody saw).
"""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import asyncckpt

REPO = Path(__file__).resolve().parents[1]


def _type_checking_imports(init: Path) -> dict[str, str]:
    """``{name: module}`` of the ``from M import N as N`` lines under ``if TYPE_CHECKING:``."""
    tree = ast.parse(init.read_text())
    found: dict[str, str] = {}
    for node in tree.body:
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            for stmt in node.body:
                assert isinstance(stmt, ast.ImportFrom) and stmt.module, ast.dump(stmt)
                for alias in stmt.names:
                    assert alias.asname == alias.name, f"{alias.name}: re-export it as itself"
                    found[alias.name] = stmt.module
    return found


def test_lazy_exports_are_declared_for_type_checkers() -> None:
    exports = {name: f"asyncckpt.{module}" for name, module in asyncckpt._EXPORTS.items()}
    assert _type_checking_imports(REPO / "asyncckpt" / "__init__.py") == exports
    assert sorted(asyncckpt.__all__) == sorted(exports)


_DEFECT_5 = """
import asyncckpt


def test_cuda_staging(tmp_path):  # unannotated, as test functions are
    with asyncckpt.CheckpointManager(tmp_path) as mgr:
        mgr.save(1, {"w": 1}).wait()
        assert mgr.{attribute} is not None
"""


def _mypy(*paths: Path, cache: Path) -> subprocess.CompletedProcess[str]:
    """mypy with the project's configuration (pyproject.toml in the repository root) on ``paths``."""
    return subprocess.run(
        [sys.executable, "-m", "mypy", "--cache-dir", str(cache), "--no-error-summary", *map(str, paths)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.timeout(330)
def test_mypy_flags_an_attribute_gone_in_an_unannotated_test(tmp_path: Path) -> None:
    pytest.importorskip("mypy")
    bad, good = tmp_path / "test_bad.py", tmp_path / "test_good.py"
    bad.write_text(textwrap.dedent(_DEFECT_5).replace("{attribute}", "stager"))
    good.write_text(textwrap.dedent(_DEFECT_5).replace("{attribute}", "last_committed_timings"))
    # A copy of the repository's mypy cache where there is one (.ci/run's mypy step, before
    # the tests, writes it): mypy then checks the two files against the cached analysis of
    # asyncckpt and torch (it re-checks whatever changed since), not all of them anew.
    cache = tmp_path / "cache"
    if (REPO / ".mypy_cache").is_dir():
        shutil.copytree(REPO / ".mypy_cache", cache)
    # One run over both files (mypy reports every file's errors; one start, not two).
    proc = _mypy(bad, good, cache=cache)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    errors = [line for line in proc.stdout.splitlines() if ": error:" in line]
    assert len(errors) == 1, proc.stdout
    assert f"{bad.name}:" in errors[0], errors
    assert '"CheckpointManager" has no attribute "stager"  [attr-defined]' in errors[0], proc.stdout
    # the same code with an attribute that exists passes: no error in test_good.py
    assert good.name not in proc.stdout, proc.stdout
