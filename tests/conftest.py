"""Test-suite set-up shared by tests/unit, tests/dist and tests/gpu."""

from __future__ import annotations

import os
import sys
from pathlib import Path

_TESTS = Path(__file__).resolve().parent
_SRC = _TESTS.parent / "src"

# Test the source tree, installed or not (the worker processes of
# shardwise.testing inherit this sys.path).
if str(_SRC) not in sys.path:
    sys.path.insert(0, str(_SRC))
# Shared test support (tests/fsdp_reference.py); spawned ranks inherit sys.path.
if str(_TESTS) not in sys.path:
    sys.path.append(str(_TESTS))
# A task whose rank dies of a fatal signal runs once more, with a warning:
# [Note: a crashed rank reruns once] in shardwise/testing/harness.py.
os.environ.setdefault("SHARDWISE_TEST_RERUN_CRASHED", "1")
