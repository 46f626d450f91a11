"""The planner: per-rank memory of a sharded model, before anything is
allocated. The only home of memory formulas (DESIGN.md); depends on
``shardwise.policies`` and torch alone."""

from shardwise.planner.memory import (
    GroupSpec,
    MemoryEstimate,
    ParamSpec,
    estimate_memory,
    groups_of,
    shard_numel,
    unsharded_model_state,
)

__all__ = [
    "GroupSpec",
    "MemoryEstimate",
    "ParamSpec",
    "estimate_memory",
    "groups_of",
    "shard_numel",
    "unsharded_model_state",
]
