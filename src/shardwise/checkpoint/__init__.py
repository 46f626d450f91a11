"""Checkpoints for sharded models: sharded and whole, optimizer included.

* :func:`save` / :func:`load`: sharded checkpoints on
  ``torch.distributed.checkpoint`` (every rank writes only its shards; loading
  reshards to any world size), committed atomically: a checkpoint directory
  becomes visible only once every rank's data and the metadata are durable.
  ``save(..., async_mode=True)`` copies the state and writes it in the
  background (``torch.distributed.checkpoint.async_save``), returning an
  :class:`AsyncSave` whose ``wait()`` returns once it is committed.
* :func:`latest`: the newest committed checkpoint under a root directory
  (``root/step-00000100/``, ...), ignoring partial ones.
* :func:`export` / :func:`load_from_file`: the whole model in one unsharded
  ``safetensors`` file (original names, full precision), or in a Hugging Face
  model directory (``config.json``, safetensors shards and their index, as
  ``save_pretrained`` writes it), gathered one group at a time; and back from
  either (or any ``save_pretrained`` directory), each rank reading only its
  own shards.

Model and optimizer state dicts themselves need nothing from this package:
``model.state_dict()`` holds the sharded DTensors, and PyTorch's
``torch.distributed.checkpoint.state_dict`` helpers (``get_model_state_dict``,
``set_optimizer_state_dict``, ... with ``StateDictOptions``) work unchanged.

Every error about a checkpoint's contents is a :class:`CheckpointError` (a
``ValueError``) raised on every rank before anything in memory is changed.
"""

from shardwise.checkpoint.commit import checkpoint_path, latest, list_checkpoints
from shardwise.checkpoint.sharded import AsyncSave, load, save
from shardwise.checkpoint.single_file import export, load_from_file
from shardwise.errors import CheckpointError

__all__ = [
    "AsyncSave",
    "CheckpointError",
    "checkpoint_path",
    "export",
    "latest",
    "list_checkpoints",
    "load",
    "load_from_file",
    "save",
]
