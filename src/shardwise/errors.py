"""The exception tree. User mistakes subclass ValueError / TypeError so that
callers can catch them the usual way; each message names the argument, the
value and the fix."""

from __future__ import annotations

__all__ = [
    "ShardwiseError",
    "ConfigError",
    "ConfigTypeError",
    "CollectiveError",
    "CheckpointError",
    "UsageError",
    "MismatchError",
    "UnsupportedError",
    "AlreadyShardedError",
    "MixedDtypeError",
    "ShardDimError",
    "CommHookError",
    "CustomCommError",
    "ExtensionError",
    "InconsistentSettingsError",
    "SummonError",
]


class ShardwiseError(Exception):
    """Base of every error shardwise raises on purpose."""


class ConfigError(ShardwiseError, ValueError):
    """A user-supplied value is wrong (bad argument, bad module layout)."""


class ConfigTypeError(ShardwiseError, TypeError):
    """A user-supplied value has the wrong type."""


class CollectiveError(ShardwiseError, RuntimeError):
    """A collective (usually a user-installed custom one) misbehaved: it raised,
    or returned a buffer of the wrong shape, dtype or device."""


class CheckpointError(ShardwiseError, ValueError):
    """A checkpoint or exported file is not what it must be (missing, incomplete,
    corrupted, or of another model), or cannot be written where asked. Raised
    before the model or optimizer in memory is touched."""


# Misuses for which PyTorch's FSDP raises RuntimeError / NotImplementedError:
# these are both, so code written for either PyTorch or the brief catches them.
class UsageError(ConfigError, RuntimeError):
    """A valid call in the wrong place or at the wrong time (e.g. on a nested
    wrapper instead of the root)."""


class MismatchError(ConfigTypeError, RuntimeError):
    """Arguments that do not fit together (e.g. a state-dict config of another
    state-dict type)."""


class UnsupportedError(ConfigError, NotImplementedError):
    """A combination of options that is refused (e.g. rank0_only with writeback)."""


class AlreadyShardedError(ConfigError, AssertionError):
    """fully_shard applied twice to one module (PyTorch asserts)."""


class ShardDimError(ConfigError, AssertionError):
    """shard_placement_fn chose a dim the parameter does not have (PyTorch asserts)."""


class MixedDtypeError(ConfigError, AssertionError):
    """The trainable parameters of one group differ in dtype and no
    ``param_dtype`` makes them one (PyTorch asserts, at the first forward)."""


class SummonError(UsageError, AssertionError):
    """summon_full_params inside forward or backward (PyTorch's FSDP1 asserts)."""


class CommHookError(UsageError, AssertionError):
    """register_comm_hook refused: a second hook, a nested wrapper, a hybrid
    strategy (PyTorch's FSDP1 asserts)."""


class CustomCommError(ConfigError, AssertionError):
    """A process group's allocator asked for where a custom AllGather /
    ReduceScatter allocates (PyTorch asserts)."""


class ExtensionError(ConfigError, AssertionError):
    """An all-gather extension (``fsdp_pre_all_gather`` / ``fsdp_post_all_gather``)
    PyTorch cannot call: one hook without the other, or a pre-hook whose
    signature is neither the one- nor the five-argument form (PyTorch asserts)."""


class InconsistentSettingsError(ConfigError, AssertionError):
    """Wrappers whose settings must agree do not (PyTorch's FSDP1 asserts)."""


MIN_TIMEOUT = 2.0
"""The shortest watchdog timeout accepted, in seconds (``shardwise.watchdog.Watchdog``
and ``shardwise train --watchdog-timeout``); anything under a minute is for tests.
It lives beside the errors it bounds so that checking a training configuration
imports no torch (``shardwise.watchdog`` re-exports it)."""
