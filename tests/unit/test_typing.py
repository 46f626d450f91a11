"""The whole package (engine, both fronts, checkpoints, train, testing,
models) stays ``mypy --strict`` clean."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src" / "shardwise"


def test_package_is_mypy_strict_clean():
    pytest.importorskip("mypy", reason="mypy is in the test extras; `make test` installs it")
    cmd = [sys.executable, "-m", "mypy", "--strict", "--no-error-summary", str(SRC)]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
