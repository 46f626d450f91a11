"""Test-suite set-up shared by tests/unit, tests/dist and tests/gpu."""

from __future__ import annotations

import fnmatch
import os
import shlex
import sys
from pathlib import Path

import pytest

_TESTS = Path(__file__).resolve().parent
_SRC = _TESTS.parent / "src"

# Test the source tree, installed or not (the worker processes of
# shardwise.testing inherit this sys.path).
if str(_SRC) not in sys.path:
    sys.path.insert(0, str(_SRC))


def pytest_configure(config: pytest.Config) -> None:
    """Import test modules by path unless the command line chose a mode.

    Test files in different folders share basenames (tests/unit/test_x.py and
    tests/dist/test_x.py), which the default "prepend" mode imports as the same
    top-level module and rejects.
    """
    args = [
        *config.invocation_params.args,
        *config.getini("addopts"),
        *shlex.split(os.environ.get("PYTEST_ADDOPTS", "")),
    ]
    if not any(str(arg).startswith("--import-mode") for arg in args):
        config.option.importmode = "importlib"


@pytest.hookimpl(tryfirst=True)
def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """Collect tests/dist, which pytest's default ``norecursedirs`` skips."""
    if collection_path != _TESTS / "dist":
        return None
    ignored = [Path(p).resolve() for p in config.getoption("ignore") or []]
    globs = [str(Path(g).resolve()) for g in config.getoption("ignore_glob") or []]
    if collection_path in ignored or any(
        fnmatch.fnmatch(str(collection_path), g) for g in globs
    ):
        return None
    return False
