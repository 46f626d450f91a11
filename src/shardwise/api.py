"""The names of PyTorch's FSDP ``api`` module (the wrapper's configuration
classes), for code that imports them from there: ``shardwise.api`` in its
place."""

from shardwise.compat import *  # noqa: F403
from shardwise.compat import __all__ as _wrapper_names

# That module holds the wrapper's configuration; the wrapper itself and
# OptimStateKeyType live in its neighbour (shardwise.fully_sharded_data_parallel).
__all__ = [n for n in _wrapper_names if n not in ("FullyShardedDataParallel", "OptimStateKeyType")]
