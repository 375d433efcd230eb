"""The code base has no undefined names, unused imports or redefinitions, and parses on every Python it supports.

ruff's pyflakes rules (F) and syntax errors (E9), over every Python file of the repository. ruff comes with the
test extras (``pip install -e ".[test]"``)."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _ruff() -> list[str]:
    try:
        import ruff  # noqa: F401
    except ImportError:
        exe = shutil.which("ruff")
        if exe is None:
            pytest.skip("ruff is not installed (it comes with the test extras: pip install -e '.[test]')")
        return [exe]
    return [sys.executable, "-m", "ruff"]


def test_pyflakes_rules_pass_over_the_repository():
    result = subprocess.run([*_ruff(), "check", "--no-cache", "--select", "F,E9", "--target-version", "py310",
                             "--output-format", "concise", str(ROOT)],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_check_fails_on_an_unused_import(tmp_path):
    """The command above reports what it is meant to (a file with an unused import fails it)."""
    bad = tmp_path / "bad.py"
    bad.write_text("import os\n")
    result = subprocess.run([*_ruff(), "check", "--no-cache", "--select", "F,E9", "--output-format", "concise",
                             str(bad)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 1 and "F401" in result.stdout, result.stdout + result.stderr
