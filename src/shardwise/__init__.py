"""shardwise: fully sharded data parallel training for PyTorch, on one engine."""

from typing import TYPE_CHECKING

from shardwise._lazy import make_lazy

if TYPE_CHECKING:
    from shardwise.comm import AllGather, Comm, ReduceScatter
    from shardwise.compat import *  # the wrapper API: exactly compat.__all__
    from shardwise.compression import QuantizedAllGather
    from shardwise.fully_shard import (
        FSDPModule,
        UnshardHandle,
        fully_shard,
        register_fsdp_forward_method,
        share_comm_ctx,
        summon_full_params,
    )
    from shardwise.mesh import DataParallelMeshDims
    from shardwise.policies import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy
    from shardwise.wrap import apply_policy

__all__ = [
    "AllGather",
    "BackwardPrefetch",
    "CPUOffload",
    "CPUOffloadPolicy",
    "Comm",
    "DataParallelMeshDims",
    "FSDPModule",
    "FullOptimStateDictConfig",
    "FullStateDictConfig",
    "FullyShardedDataParallel",
    "LocalOptimStateDictConfig",
    "LocalStateDictConfig",
    "MixedPrecision",
    "MixedPrecisionPolicy",
    "OffloadPolicy",
    "OptimStateDictConfig",
    "OptimStateKeyType",
    "QuantizedAllGather",
    "ReduceScatter",
    "ShardedOptimStateDictConfig",
    "ShardedStateDictConfig",
    "ShardingStrategy",
    "StateDictConfig",
    "StateDictSettings",
    "StateDictType",
    "UnshardHandle",
    "apply_policy",
    "fully_shard",
    "register_fsdp_forward_method",
    "share_comm_ctx",
    "summon_full_params",
]

__version__ = "0.1.0"

# Each public name loads its submodule (and torch) when first used.
make_lazy(__name__, {
    "AllGather": "comm",
    "Comm": "comm",
    "ReduceScatter": "comm",
    "BackwardPrefetch": "compat",
    "CPUOffload": "compat",
    "FullOptimStateDictConfig": "compat",
    "FullStateDictConfig": "compat",
    "FullyShardedDataParallel": "compat",
    "LocalOptimStateDictConfig": "compat",
    "LocalStateDictConfig": "compat",
    "MixedPrecision": "compat",
    "OptimStateDictConfig": "compat",
    "OptimStateKeyType": "compat",
    "ShardedOptimStateDictConfig": "compat",
    "ShardedStateDictConfig": "compat",
    "ShardingStrategy": "compat",
    "StateDictConfig": "compat",
    "StateDictSettings": "compat",
    "StateDictType": "compat",
    "QuantizedAllGather": "compression",
    "FSDPModule": "fully_shard",
    "UnshardHandle": "fully_shard",
    "fully_shard": "fully_shard",
    "register_fsdp_forward_method": "fully_shard",
    "share_comm_ctx": "fully_shard",
    "summon_full_params": "fully_shard",
    "DataParallelMeshDims": "mesh",
    "CPUOffloadPolicy": "policies",
    "MixedPrecisionPolicy": "policies",
    "OffloadPolicy": "policies",
    "apply_policy": "wrap",
})
