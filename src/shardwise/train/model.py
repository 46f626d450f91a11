"""The model ``shardwise train`` trains, and how it is sharded: the built-in
GPT or a Hugging Face causal LM built from a config; per-block
``fully_shard`` (or one group for the whole model); mixed precision, CPU
offload, shard-grad-op, hybrid sharding; activation checkpointing.

[Note: initialising a sharded GPT]
The built-in GPT is built on the meta device, sharded, materialised with
``to_empty`` and then initialised group by group inside
``summon_full_params`` (the root's group for the whole walk, each block's
only while it is initialised), in the module order an eager build uses. So
the weights equal an eager ``GPT(cfg)``'s under the same seed, whatever the
world size, and no rank ever holds more than the root plus one block whole.

[Note: initialising a sharded Hugging Face model]
A Hugging Face model (transformers 5) is built the same way: on the meta
device, sharded, materialised with ``to_empty`` (each rank allocates only its
shards), then

* from scratch: transformers' own ``initialize_weights`` walk (children
  before parents, each module through the ``_init_weights`` of the
  ``PreTrainedModel`` it belongs to, under ``transformers.initialization``'s
  guard), seeded with ``seed``, run group by group inside
  ``summon_full_params`` as for the GPT. The weights are those of a
  meta-built copy that is materialised and then given
  ``torch.manual_seed(seed); model.initialize_weights()``, at every world size
  (an eager ``from_config`` build draws other numbers: its constructors
  consume the generator first).
* with ``init_from``: as ``from_pretrained`` does when it loads onto the meta
  device, every tensor of the state dict is marked as loaded
  (``_is_hf_initialized``) and ``initialize_weights`` is run, which then
  (re)computes only what a checkpoint does not hold: the non-persistent
  buffers, such as the rotary ``inv_freq``. The weights come from the files
  (``load_from_file``, each rank reading its own chunks).
"""

from __future__ import annotations

import contextlib
import difflib
import functools
import importlib
import importlib.metadata
import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from shardwise.errors import ConfigError
from shardwise.models import GPT, GPTConfig, init_module_
from shardwise.planner import GroupSpec, groups_of
from shardwise.policies import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy
from shardwise.train.config import TrainConfig

__all__ = [
    "BuiltModel",
    "build_model",
    "check_transformers",
    "hf_config_file",
    "hf_vocab_size",
    "mixed_precision",
    "offload_policy",
    "planner_groups",
    "reshard_after_forward",
    "shard_model",
]


@dataclass
class BuiltModel:
    """A model with what the trainer needs to know about it."""

    model: nn.Module
    blocks: list[nn.Module]  # the repeated layers: one communication group each (wrap="blocks")
    description: str  # e.g. "GPT 4 x 128"
    logits: Callable[[Tensor], Tensor]  # token ids [B, T] -> logits [B, T, V]


def check_transformers() -> None:
    """A :class:`ConfigError` unless ``transformers`` 5 or later is importable."""
    if importlib.util.find_spec("transformers") is None:
        raise ConfigError(
            "model='hf' needs the 'transformers' package, which is not installed: run "
            "`pip install transformers`, or use the built-in model (--model gpt)"
        )
    version = importlib.metadata.version("transformers")
    if int(version.split(".")[0]) < 5:
        raise ConfigError(
            f"model='hf' needs transformers 5 or later (it initialises models built on the meta device the way "
            f"transformers 5 does), but {version} is installed: run `pip install -U transformers`"
        )


def hf_config_file(cfg: TrainConfig) -> Path | None:
    """Where ``model='hf'`` takes its config from: ``hf_config`` (a config.json
    or its directory) if set, else ``init_from``'s ``config.json`` when
    ``init_from`` is a directory; ``None``: built from ``hf_model_type`` and the
    size settings. ``hf_config`` wins over ``init_from``'s config.json (e.g. to
    change settings that leave the weights' shapes alone); a config whose
    shapes do not fit the weights is refused before any rank starts.

    Raises:
        ConfigError: ``hf_config`` does not exist, or ``init_from`` is a
            directory without ``config.json``.
    """
    if cfg.model != "hf":
        return None
    if cfg.hf_config:
        path = Path(cfg.hf_config)
        if not path.exists():
            raise ConfigError(f"hf_config={cfg.hf_config!r} does not exist: pass a local config.json or its directory")
        return path
    if cfg.init_from and Path(cfg.init_from).is_dir():
        path = Path(cfg.init_from) / "config.json"
        if not path.is_file():
            raise ConfigError(
                f"init_from={cfg.init_from!r} is a directory without config.json, which model='hf' builds the "
                "model from: add the config.json the weights were saved with (save_pretrained writes one), or "
                "pass --hf-config"
            )
        return path
    return None


def hf_vocab_size(cfg: TrainConfig) -> int | None:
    """The vocabulary size in ``model='hf'``'s config file (:func:`hf_config_file`), if there is one."""
    path = hf_config_file(cfg)
    if path is None:
        return None
    check_transformers()
    transformers = importlib.import_module("transformers")
    vocab = getattr(transformers.AutoConfig.from_pretrained(str(path)), "vocab_size", None)
    return vocab if isinstance(vocab, int) and vocab > 0 else None


def _gpt(cfg: TrainConfig, vocab_size: int, device: torch.device) -> BuiltModel:
    gcfg = GPTConfig(vocab_size=vocab_size, seq_len=cfg.seq_len, dim=cfg.dim, n_layers=cfg.n_layers,
                     n_heads=cfg.n_heads, mlp_ratio=cfg.mlp_ratio, dropout=cfg.dropout)
    with torch.device("meta"):
        model = GPT(gcfg)
    return BuiltModel(model, list(model.blocks), f"GPT {cfg.n_layers} x {cfg.dim}", model)


def _hf_config(cfg: TrainConfig, vocab_size: int) -> Any:
    transformers = importlib.import_module("transformers")
    path = hf_config_file(cfg)
    if path is not None:
        hf = transformers.AutoConfig.from_pretrained(str(path))
        hf.vocab_size = vocab_size
        return hf
    try:
        return transformers.AutoConfig.for_model(
            cfg.hf_model_type, vocab_size=vocab_size, hidden_size=cfg.dim, num_hidden_layers=cfg.n_layers,
            num_attention_heads=cfg.n_heads, num_key_value_heads=cfg.n_heads,
            intermediate_size=cfg.mlp_ratio * cfg.dim, max_position_embeddings=cfg.seq_len,
        )
    except ValueError:
        auto = importlib.import_module("transformers.models.auto.configuration_auto")
        known = list(getattr(auto, "CONFIG_MAPPING_NAMES", {}))
        close = difflib.get_close_matches(cfg.hf_model_type, known, n=3)
        hint = f"did you mean {', '.join(map(repr, close))}? " if close else ""
        raise ConfigError(
            f"hf_model_type={cfg.hf_model_type!r} is not a transformers model type: {hint}Use a decoder-only type "
            "such as 'llama', 'qwen2' or 'mistral', or pass hf_config"
        ) from None


def _decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The model's repeated decoder layers: modules of its ``_no_split_modules``
    classes, else the children of its longest ``ModuleList``."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if layers:
        return layers
    lists: list[nn.ModuleList] = [m for m in model.modules() if isinstance(m, nn.ModuleList)]
    longest = max(lists, key=lambda m: len(m), default=None)
    return list(longest) if longest is not None else []


def _hf(cfg: TrainConfig, vocab_size: int, device: torch.device) -> BuiltModel:
    check_transformers()
    transformers = importlib.import_module("transformers")
    hf_cfg = _hf_config(cfg, vocab_size)
    with torch.device("meta"):  # see [Note: initialising a sharded Hugging Face model]
        model = transformers.AutoModelForCausalLM.from_config(hf_cfg)
    layers = _decoder_layers(model)
    if not layers:
        raise ConfigError(
            f"found no decoder layers in {type(model).__name__} to wrap: use wrap='root' to shard it as one group"
        )

    def logits(idx: Tensor) -> Tensor:
        return model(input_ids=idx, use_cache=False).logits  # type: ignore[no-any-return]

    width = getattr(hf_cfg, "hidden_size", cfg.dim)
    return BuiltModel(model, layers, f"{type(model).__name__} {len(layers)} x {width}", logits)


def build_model(cfg: TrainConfig, vocab_size: int, device: torch.device) -> BuiltModel:
    """The unsharded model, on the meta device (nothing is allocated):
    :func:`shard_model` materialises each rank's shards and initialises them,
    see [Note: initialising a sharded GPT] and [Note: initialising a sharded
    Hugging Face model].

    Args:
        cfg: the configuration.
        vocab_size: the resolved vocabulary size.
        device: the compute device (unused: every model is built on ``meta``).
    """
    if cfg.model == "gpt":
        return _gpt(cfg, vocab_size, device)
    return _hf(cfg, vocab_size, device)


def mixed_precision(cfg: TrainConfig) -> MixedPrecisionPolicy:
    """The mixed-precision policy for ``cfg.precision``."""
    if cfg.precision == "bf16":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()


def offload_policy(cfg: TrainConfig) -> OffloadPolicy:
    """``CPUOffloadPolicy()`` with ``cfg.offload``, else no offload."""
    return CPUOffloadPolicy() if cfg.offload else OffloadPolicy()


def reshard_after_forward(cfg: TrainConfig) -> bool:
    """``False`` for shard-grad-op (parameters stay gathered until backward), else ``True``."""
    return cfg.strategy != "shard-grad-op"


def planner_groups(built: BuiltModel, cfg: TrainConfig) -> list[GroupSpec]:
    """The communication groups :func:`shard_model` makes, for the planner."""
    return groups_of(built.model, built.blocks if cfg.wrap == "blocks" else [])


def _checkpointed(module: nn.Module) -> None:
    """Recompute ``module``'s forward in backward. The instance's ``forward`` is
    replaced (names and hooks stay as they are), so ``fully_shard``'s hooks run
    outside the checkpointed region and the recomputation uses the parameters
    the pre-backward hook gathered."""
    inner = module.forward

    @functools.wraps(inner)
    def forward(*args: Any, **kwargs: Any) -> Any:
        return checkpoint(inner, *args, use_reentrant=False, **kwargs)

    module.forward = forward


def shard_model(built: BuiltModel, cfg: TrainConfig, mesh: Any, device: torch.device, *,
                initialise: bool = True) -> None:
    """Apply ``fully_shard`` (blocks bottom-up, then the root), activation
    checkpointing, and materialise the shards on ``device`` and initialise
    them: from ``seed``, or, for a Hugging Face model with ``init_from``, only
    its non-persistent buffers (the caller then loads the weights).

    Args:
        built: from :func:`build_model`.
        cfg: the configuration.
        mesh: the 1-D or 2-D (replicate, shard) device mesh.
        device: the compute device.
        initialise: initialise the weights; ``False`` leaves the shards
            uninitialised (the planner's fake run, which needs no values).
            (Default: ``True``)
    """
    from shardwise.fully_shard import fully_shard, summon_full_params

    kw: dict[str, Any] = {"mesh": mesh, "mp_policy": mixed_precision(cfg), "offload_policy": offload_policy(cfg)}
    raf = reshard_after_forward(cfg)
    if cfg.activation_checkpointing:
        for block in built.blocks:
            _checkpointed(block)
    if cfg.wrap == "blocks":
        for block in built.blocks:
            fully_shard(block, reshard_after_forward=raf, **kw)
    fully_shard(built.model, reshard_after_forward=None if raf else False, **kw)
    model = built.model
    model.to_empty(device=device)
    if not initialise:
        return
    if isinstance(model, GPT):
        _init_gpt(model, cfg, summon_full_params)
    elif cfg.init_from:
        _init_hf_buffers(model)
    else:
        _init_hf(model, built.blocks, cfg, summon_full_params)


def _init_gpt(model: GPT, cfg: TrainConfig, summon: Callable[..., Any]) -> None:
    """See [Note: initialising a sharded GPT]."""
    torch.manual_seed(cfg.seed)
    blocks = {id(b): b for b in model.blocks}
    in_block: set[int] = set()
    for block in model.blocks:
        in_block.update(id(m) for m in block.modules())
    with summon(model, recurse=cfg.wrap == "root"):
        for module in model.modules():
            if id(module) in blocks:
                if cfg.wrap == "blocks":
                    with summon(module, recurse=False):
                        module.init_weights()  # type: ignore[operator]
                else:
                    module.init_weights()  # type: ignore[operator]
            elif id(module) in in_block:
                continue
            elif module is model.lm_head and model.cfg.tie_embeddings:
                continue
            else:
                init_module_(module)


def _init_hf(model: nn.Module, blocks: list[nn.Module], cfg: TrainConfig, summon: Callable[..., Any]) -> None:
    """See [Note: initialising a sharded Hugging Face model]: transformers'
    ``initialize_weights`` walk (``PreTrainedModel.smart_apply``), one group
    gathered at a time."""
    transformers = importlib.import_module("transformers")
    init = importlib.import_module("transformers.initialization")
    pretrained = transformers.PreTrainedModel
    is_custom: Any = getattr(model, "is_custom_code", None)
    custom = bool(is_custom()) if callable(is_custom) else False
    gathered = {id(b) for b in blocks} if cfg.wrap == "blocks" else set()

    def visit(module: nn.Module, top: Any) -> None:
        with summon(module, recurse=False) if id(module) in gathered else contextlib.nullcontext():
            for child in module.children():
                visit(child, child if isinstance(child, pretrained) else top)
            top._initialize_weights(module, custom)

    torch.manual_seed(cfg.seed)
    with torch.no_grad(), init.guard_torch_init_functions(), summon(model, recurse=cfg.wrap == "root"):
        visit(model, model)


def _init_hf_buffers(model: nn.Module) -> None:
    """See [Note: initialising a sharded Hugging Face model]: what
    ``from_pretrained`` does for the tensors a checkpoint does not hold."""
    loaded = list(model.state_dict(keep_vars=True).values())
    for t in loaded:
        t._is_hf_initialized = True
    try:
        model.initialize_weights()  # type: ignore[operator]
    finally:
        for t in loaded:
            with contextlib.suppress(AttributeError):
                del t._is_hf_initialized
