"""The names of PyTorch's FSDP ``fully_sharded_data_parallel`` module, for
code that imports the wrapper from there: ``shardwise.fully_sharded_data_parallel``
in its place. The configuration classes that module also holds come with it."""

from shardwise.api import *  # noqa: F403 (PyTorch's module holds these too, outside its __all__)
from shardwise.compat import FullyShardedDataParallel, OptimStateKeyType

__all__ = ["FullyShardedDataParallel", "OptimStateKeyType"]
