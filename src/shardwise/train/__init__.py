"""``shardwise train``: sharded training of a GPT-style model from the command
line, on one machine (``--nproc`` local ranks) or many (``torchrun``).

* ``config``   the settings: TOML keys = flags, validated
* ``data``     token streams (text bytes, uint16 / uint32 ``.bin``, Python's own text), per-rank slices
* ``model``    the built-in GPT or a Hugging Face causal LM, and how it is sharded
* ``schedule`` warm-up + cosine learning rate
* ``launch``   checks before any rank starts, dry run
* ``ranks``    the local ranks' environment and the fork server they start from
* ``loop``     one rank's training: steps, checkpoints, export, summary; starting the ranks
* ``report``   progress bar and tables; ``plot`` the PNG of loss and memory
"""

from typing import TYPE_CHECKING

from shardwise._lazy import make_lazy

if TYPE_CHECKING:
    from shardwise.train.config import TrainConfig, load_toml, resolve
    from shardwise.train.launch import Plan, World, dry_run, preflight, torchrun_world
    from shardwise.train.loop import launch

__all__ = ["Plan", "TrainConfig", "World", "dry_run", "launch", "load_toml", "preflight", "resolve", "torchrun_world"]

# Each name loads its submodule (and torch) when first used: the command parses
# its flags (``config``) without torch.
make_lazy(__name__, {
    "TrainConfig": "config", "load_toml": "config", "resolve": "config",
    "Plan": "launch", "World": "launch", "dry_run": "launch", "preflight": "launch", "torchrun_world": "launch",
    "launch": "loop",
})
