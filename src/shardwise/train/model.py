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
A Hugging Face model is built eagerly (its non-persistent buffers, such as
rotary frequencies, are computed at construction) and then sharded.
"""

from __future__ import annotations

import difflib
import functools
import importlib
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
    """A :class:`ConfigError` unless the ``transformers`` package is importable."""
    if importlib.util.find_spec("transformers") is None:
        raise ConfigError(
            "model='hf' needs the 'transformers' package, which is not installed: run "
            "`pip install transformers`, or use the built-in model (--model gpt)"
        )


def _gpt(cfg: TrainConfig, vocab_size: int, device: torch.device) -> BuiltModel:
    gcfg = GPTConfig(vocab_size=vocab_size, seq_len=cfg.seq_len, dim=cfg.dim, n_layers=cfg.n_layers,
                     n_heads=cfg.n_heads, mlp_ratio=cfg.mlp_ratio, dropout=cfg.dropout)
    with torch.device("meta"):
        model = GPT(gcfg)
    return BuiltModel(model, list(model.blocks), f"GPT {cfg.n_layers} x {cfg.dim}", model)


def _hf_config(cfg: TrainConfig, vocab_size: int) -> Any:
    transformers = importlib.import_module("transformers")
    if cfg.hf_config:
        path = Path(cfg.hf_config)
        if not path.exists():
            raise ConfigError(f"hf_config={cfg.hf_config!r} does not exist: pass a local config.json or its directory")
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
    if device.type == "meta":
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(hf_cfg)
    else:
        torch.manual_seed(cfg.seed)
        model = transformers.AutoModelForCausalLM.from_config(hf_cfg).to(device)
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
    """The unsharded model; on ``device="meta"`` nothing is allocated (the
    built-in GPT is always built there first, see [Note: initialising a sharded GPT]).

    Args:
        cfg: the configuration.
        vocab_size: the resolved vocabulary size.
        device: where a Hugging Face model is built (``meta`` for a dry run).
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


def shard_model(built: BuiltModel, cfg: TrainConfig, mesh: Any, device: torch.device) -> None:
    """Apply ``fully_shard`` (blocks bottom-up, then the root), activation
    checkpointing, and materialise + initialise the built-in GPT on ``device``.

    Args:
        built: from :func:`build_model`.
        cfg: the configuration.
        mesh: the 1-D or 2-D (replicate, shard) device mesh.
        device: the compute device.
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
    if isinstance(model, GPT):
        model.to_empty(device=device)
        _init_gpt(model, cfg, summon_full_params)


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
