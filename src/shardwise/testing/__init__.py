"""Testing utilities for shardwise and for models sharded with it.

:func:`multi_rank` and :func:`run_on_ranks` run test code on every rank of a
gloo process group, in worker processes that live for the whole pytest
session; :class:`RankFailure` reports what went wrong on which rank. The
parity helpers compare a sharded model against an unsharded reference trained
alongside it.
"""

from shardwise.testing.harness import RankFailure, multi_rank, run_on_ranks
from shardwise.testing.parity import (
    assert_models_match,
    assert_same_on_all_ranks,
    full_tensor,
    replicate_grads,
)

__all__ = [
    "RankFailure",
    "assert_models_match",
    "assert_same_on_all_ranks",
    "full_tensor",
    "multi_rank",
    "replicate_grads",
    "run_on_ranks",
]
