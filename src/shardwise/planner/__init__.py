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
from shardwise.planner.simulate import fake_world, rank_classes
from shardwise.planner.tracker import CATEGORIES, COLLECTIVES, MemoryTracker, StepMemory, TimelinePoint

__all__ = [
    "CATEGORIES",
    "COLLECTIVES",
    "GroupSpec",
    "MemoryTracker",
    "StepMemory",
    "TimelinePoint",
    "fake_world",
    "rank_classes",
    "MemoryEstimate",
    "ParamSpec",
    "estimate_memory",
    "groups_of",
    "shard_numel",
    "unsharded_model_state",
]
