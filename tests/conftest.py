"""Test-suite set-up shared by tests/unit, tests/dist and tests/gpu."""

from __future__ import annotations

import sys
from pathlib import Path

_SRC = Path(__file__).resolve().parent.parent / "src"

# Test the source tree, installed or not (the worker processes of
# shardwise.testing inherit this sys.path).
if str(_SRC) not in sys.path:
    sys.path.insert(0, str(_SRC))
