"""shardwise: fully sharded data parallel training for PyTorch, on one engine."""

from shardwise.comm import AllGather, Comm, ReduceScatter
from shardwise.compression import QuantizedAllGather
from shardwise.fully_shard import (
    FSDPModule,
    UnshardHandle,
    fully_shard,
    register_fsdp_forward_method,
    summon_full_params,
)
from shardwise.policies import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy

__all__ = [
    "AllGather",
    "CPUOffloadPolicy",
    "Comm",
    "FSDPModule",
    "MixedPrecisionPolicy",
    "OffloadPolicy",
    "QuantizedAllGather",
    "ReduceScatter",
    "UnshardHandle",
    "fully_shard",
    "register_fsdp_forward_method",
    "summon_full_params",
]

__version__ = "0.1.0"
