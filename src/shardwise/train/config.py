"""The configuration of ``shardwise train``: one frozen dataclass whose fields
are at once the TOML keys and the command-line flags (``seq_len`` is
``--seq-len``), so a value means the same in both places.

Resolution order: the field's default, then the TOML file, then the flags.
A TOML file may put keys at its top level or under the section a key belongs
to (``[model]``, ``[parallel]``, ``[optim]``, ``[data]``, ``[checkpoint]``,
``[output]``); an unknown key or section is an error naming the nearest valid
one.
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import math
import sys
from collections.abc import Mapping
from dataclasses import MISSING, asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from shardwise.errors import MIN_TIMEOUT, ConfigError, ConfigTypeError
from shardwise.train.plot import check_matplotlib

__all__ = [
    "SECTIONS",
    "TrainConfig",
    "add_flags",
    "as_dict",
    "config_from_flags",
    "load_toml",
    "nearest_key",
    "render_toml",
    "resolve",
    "synonym",
]

SECTIONS = ("model", "parallel", "optim", "data", "checkpoint", "output")
MODELS = ("gpt", "hf")
STRATEGIES = ("full", "shard-grad-op", "hybrid")
WRAPS = ("blocks", "root")
PRECISIONS = ("fp32", "bf16")
DEVICES = ("auto", "cpu", "cuda")
LOG_LEVELS = ("debug", "info", "warning", "error")


def _opt(default: Any, section: str, help: str, *, choices: tuple[str, ...] | None = None) -> Any:
    """A config field: its default, TOML section, help text and allowed values."""
    return field(default=default, metadata={"section": section, "help": help, "choices": choices})


@dataclass(frozen=True)
class TrainConfig:
    """Everything ``shardwise train`` needs; validated on construction.

    Each field is a TOML key and a flag; see ``shardwise train --help`` for
    the meaning of each (the ``help`` in the field's metadata).
    """

    # [model]
    model: str = _opt("gpt", "model", "built-in GPT ('gpt') or a Hugging Face causal LM built from a config ('hf')",
                      choices=MODELS)
    hf_model_type: str = _opt("llama", "model", "model=hf: the transformers model type (AutoConfig.for_model), "
                              "sized by dim, n_layers, n_heads, seq_len")
    hf_config: str = _opt("", "model", "model=hf: a local config.json (or its directory) to use instead of "
                          "hf_model_type; no weights are downloaded")
    dim: int = _opt(128, "model", "model width")
    n_layers: int = _opt(4, "model", "transformer blocks")
    n_heads: int = _opt(4, "model", "attention heads")
    mlp_ratio: int = _opt(4, "model", "MLP hidden width / dim")
    seq_len: int = _opt(64, "model", "tokens per training sequence (context length)")
    vocab_size: int = _opt(0, "model", "vocabulary size; 0: 256 for text (bytes), the largest id + 1 "
                           "(rounded up to 64) for a .bin (set, a .bin is not scanned: its ids must be below it)")
    dropout: float = _opt(0.0, "model", "dropout probability")
    init_from: str = _opt("", "model", "initialise the model from a safetensors file (e.g. an --export) or a Hugging Face model directory")
    # [parallel]
    nproc: int = _opt(2, "parallel", "local ranks to launch (ignored under torchrun)")
    strategy: str = _opt("full", "parallel", "full: shard params, grads, optimizer state (ZeRO-3); "
                         "shard-grad-op: keep params gathered from forward to backward (ZeRO-2); "
                         "hybrid: shard within groups of shard_size ranks, replicate across them",
                         choices=STRATEGIES)
    shard_size: int = _opt(0, "parallel", "strategy=hybrid: ranks per shard group; 0: the ranks of one node "
                           "(LOCAL_WORLD_SIZE under torchrun, else half the ranks)")
    wrap: str = _opt("blocks", "parallel", "blocks: one communication group per transformer block plus the root; "
                     "root: the whole model as one group", choices=WRAPS)
    precision: str = _opt("fp32", "parallel", "fp32, or bf16 compute with fp32 master weights and fp32 "
                          "gradient reduction", choices=PRECISIONS)
    offload: bool = _opt(False, "parallel", "keep sharded params, grads and optimizer state in host memory "
                         "(CPUOffloadPolicy)")
    activation_checkpointing: bool = _opt(False, "parallel", "recompute each block's activations in backward "
                                          "(torch.utils.checkpoint)")
    device: str = _opt("auto", "parallel", "auto: CUDA (NCCL) when available, else CPU (gloo)", choices=DEVICES)
    watchdog_timeout: float = _opt(300.0, "parallel", "end the run with a message naming the stuck rank when a "
                                   "rank has waited this many seconds on another that makes no progress (stopped, "
                                   "deadlocked, in another collective); 0: no watchdog")
    # [optim]
    steps: int = _opt(500, "optim", "optimizer steps (the length of the LR schedule)")
    batch_size: int = _opt(16, "optim", "sequences per optimizer step, all ranks together; split evenly over "
                           "ranks and grad_accum micro-steps")
    grad_accum: int = _opt(1, "optim", "micro-steps per optimizer step (gradient accumulation)")
    lr: float = _opt(3e-3, "optim", "peak learning rate (AdamW)")
    min_lr: float = _opt(3e-4, "optim", "learning rate at the end of the cosine decay")
    warmup_steps: int = _opt(50, "optim", "linear warm-up steps from 0 to lr")
    weight_decay: float = _opt(0.1, "optim", "AdamW weight decay (matrices only)")
    beta1: float = _opt(0.9, "optim", "AdamW beta1")
    beta2: float = _opt(0.95, "optim", "AdamW beta2")
    grad_clip: float = _opt(1.0, "optim", "clip the global gradient norm to this; 0: no clipping")
    seed: int = _opt(0, "optim", "seed of the initial weights and the data order")
    # [data]
    data: tuple[str, ...] = _opt((), "data", "text files or directories (byte-level tokens), or one .bin of "
                                 "token ids: uint16 (nanoGPT's raw ids), uint32 if named *.uint32.bin (e.g. "
                                 "Llama-3's 128,256 ids), or what llm.c's 1 KiB header says; empty: text that "
                                 "ships with Python (stdlib sources and docs)")
    # [checkpoint]
    checkpoint_dir: str = _opt("checkpoints", "checkpoint", "where checkpoints go (step-NNNNNNNN/ inside)")
    checkpoint_every: int = _opt(0, "checkpoint", "save a sharded checkpoint every K steps (and at the end); "
                                 "0: never")
    keep: int = _opt(0, "checkpoint", "keep only the newest K checkpoints; 0: keep all")
    checkpoint_async: bool = _opt(False, "checkpoint", "write checkpoints in the background: training waits only "
                                  "while each rank copies its state to host memory (held once more until written); "
                                  "the run's last checkpoint is waited for")
    resume: bool = _opt(False, "checkpoint", "continue from the latest complete checkpoint in checkpoint_dir")
    export: str = _opt("", "checkpoint", "write the unsharded model here at the end: a path ending in .safetensors "
                       "is one file; any other path a Hugging Face model directory (config.json, safetensors shards "
                       "and their index, as save_pretrained writes)")
    export_shard_size: str = _opt("5GB", "checkpoint", "export to a directory: the largest safetensors shard file "
                                  "(bytes, or e.g. 5GB, 500MB, 1GiB)")
    stop_at: int = _opt(0, "checkpoint", "stop after this step (checkpointing it), as a time-limited job "
                        "would; --resume continues; 0: run all steps")
    # [output]
    log_every: int = _opt(0, "output", "progress line every K steps when not on a terminal; 0: about 20 "
                          "lines per run")
    plot: str = _opt("", "output", "write a PNG of loss and memory over the steps to this file (needs matplotlib: "
                     "pip install 'shardwise[plot]')")
    metrics: str = _opt("", "output", "append one JSON line per step (step, loss, lr, tokens/s, memory) "
                        "to this file")
    log_level: str = _opt("info", "output", "what the run shows: info (rank 0's progress and summary), debug "
                          "(more), warning or error (only problems); other ranks show warnings and errors",
                          choices=LOG_LEVELS)
    dry_run: bool = _opt(False, "output", "print the resolved configuration and the per-rank memory "
                         "estimate; allocate nothing, start no rank")

    def __post_init__(self) -> None:
        for f in fields(self):
            object.__setattr__(self, f.name, _coerce(f.name, getattr(self, f.name), f.default))
        for f in fields(self):
            choices = f.metadata.get("choices")
            value = getattr(self, f.name)
            if choices and value not in choices:
                raise ConfigError(
                    f"{f.name}={value!r} is not one of {', '.join(choices)}: set {f.name} to one of them"
                    + _nearest_hint(str(value), choices)
                )
        for name in ("dim", "n_layers", "n_heads", "mlp_ratio", "seq_len", "nproc", "steps", "batch_size",
                     "grad_accum"):
            _at_least(name, getattr(self, name), 1)
        for name in ("vocab_size", "shard_size", "warmup_steps", "seed", "checkpoint_every", "keep", "stop_at",
                     "log_every"):
            _at_least(name, getattr(self, name), 0)
        for name in ("lr", "min_lr", "weight_decay", "grad_clip"):
            value = getattr(self, name)
            if not math.isfinite(value) or value < 0:
                raise ConfigError(f"{name}={value!r} must be a finite number >= 0 (default {_default(name)!r})")
        if self.watchdog_timeout and not self.watchdog_timeout >= MIN_TIMEOUT:
            raise ConfigError(
                f"watchdog_timeout={self.watchdog_timeout!r} must be 0 (off) or a number of seconds >= "
                f"{MIN_TIMEOUT:g} (default {_default('watchdog_timeout')!r}; under a minute only for tests)"
            )
        if self.min_lr > self.lr:
            raise ConfigError(f"min_lr={self.min_lr} exceeds lr={self.lr}: set min_lr <= lr (e.g. min_lr={self.lr / 10:g})")
        for name in ("beta1", "beta2", "dropout"):
            value = getattr(self, name)
            if not 0.0 <= value < 1.0:
                raise ConfigError(f"{name}={value!r} must lie in [0, 1) (default {_default(name)!r})")
        if self.model == "gpt" and self.dim % self.n_heads:
            raise ConfigError(
                f"dim={self.dim} is not divisible by n_heads={self.n_heads}: use a multiple of n_heads "
                f"(e.g. dim={-(-self.dim // self.n_heads) * self.n_heads})"
            )
        if self.stop_at > self.steps:
            raise ConfigError(f"stop_at={self.stop_at} is past steps={self.steps}: set stop_at <= steps, or 0")
        check_matplotlib(self.plot)
        if self.vocab_size and self.vocab_size < 256 and not self._bin_data():
            raise ConfigError(
                f"vocab_size={self.vocab_size} is too small for byte-level text (256 symbols): "
                "set vocab_size >= 256, or 0 for automatic"
            )

    def _bin_data(self) -> bool:
        return len(self.data) == 1 and self.data[0].endswith(".bin")

    def micro_batch(self, world_size: int) -> int:
        """Sequences per rank per micro-step, checking that ``batch_size``
        splits evenly over ``world_size`` ranks and ``grad_accum`` micro-steps.

        Args:
            world_size: ranks training together.
        """
        parts = world_size * self.grad_accum
        if self.batch_size % parts == 0:
            return self.batch_size // parts
        fits = [n for n in range(1, self.batch_size + 1) if self.batch_size % (n * self.grad_accum) == 0]
        bigger = -(-self.batch_size // parts) * parts
        accum = f" x grad_accum={self.grad_accum} micro-steps" if self.grad_accum > 1 else ""
        raise ConfigError(
            f"batch_size={self.batch_size} sequences cannot be split evenly over {world_size} ranks{accum}: "
            f"use a number of ranks in {{{', '.join(map(str, fits))}}} (--nproc, or torchrun's nodes x "
            f"--nproc-per-node), or a batch_size that is a multiple of {parts} (e.g. --batch-size {bigger})"
        )

    def hybrid_shard_size(self, world_size: int, local_size: int | None = None) -> int:
        """Ranks per shard group for ``strategy='hybrid'`` on ``world_size``
        ranks (``shard_size``, else the ranks of one node when ``local_size``
        says so, else half the ranks); ``0`` for the other strategies.

        Args:
            world_size: all ranks.
            local_size: ranks per node under torchrun. (Default: ``None``: not under torchrun)
        """
        if self.strategy != "hybrid":
            if self.shard_size:
                raise ConfigError(
                    f"shard_size={self.shard_size} only applies to strategy='hybrid' (got strategy="
                    f"{self.strategy!r}): set strategy='hybrid' or drop shard_size"
                )
            return 0
        size = self.shard_size
        if not size:
            size = local_size if local_size is not None and local_size < world_size else world_size // 2
        if size < 1 or world_size % size:
            raise ConfigError(
                f"strategy='hybrid' with shard_size={size or self.shard_size} on {world_size} ranks: the shard groups "
                f"must divide the world; set shard_size to a divisor of {world_size} smaller than it "
                f"(e.g. {max(1, world_size // 2)}) or use strategy='full'"
            )
        return size

    def section_items(self) -> dict[str, dict[str, Any]]:
        """The values by TOML section, in field order (for printing)."""
        out: dict[str, dict[str, Any]] = {s: {} for s in SECTIONS}
        for f in fields(self):
            out[f.metadata["section"]][f.name] = getattr(self, f.name)
        return out


def _default(name: str) -> Any:
    return TrainConfig.__dataclass_fields__[name].default


def _at_least(name: str, value: int, low: int) -> None:
    if value < low:
        raise ConfigError(f"{name}={value!r} must be an integer >= {low} (default {_default(name)!r})")


def _coerce(name: str, value: Any, default: Any) -> Any:
    """``value`` as the type of ``default``; a TypeError naming the key otherwise."""
    kind = type(default)
    if kind is tuple:
        if isinstance(value, str):
            return (value,) if value else ()
        if isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
            return tuple(value)
    elif kind is bool:
        if isinstance(value, bool):
            return value
    elif kind is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif kind is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    elif kind is str:
        if isinstance(value, str):
            return value
    wanted = {tuple: "a string or a list of strings", bool: "true or false", int: "an integer",
              float: "a number", str: "a string"}[kind]
    raise ConfigTypeError(f"{name}={value!r} must be {wanted} (default {default!r})")


def _nearest_hint(word: str, candidates: tuple[str, ...] | list[str]) -> str:
    close = difflib.get_close_matches(word, list(candidates), n=1, cutoff=0.5)
    return f" (did you mean {close[0]!r}?)" if close else ""


# Names other trainers use for our keys: the "nearest valid key" for them.
_SYNONYMS = {
    "learning_rate": "lr", "max_lr": "lr", "n_layer": "n_layers", "num_layers": "n_layers", "layers": "n_layers",
    "n_head": "n_heads", "num_heads": "n_heads", "heads": "n_heads", "block_size": "seq_len",
    "context_length": "seq_len", "max_seq_len": "seq_len", "seq_length": "seq_len", "n_embd": "dim",
    "d_model": "dim", "hidden_size": "dim", "width": "dim", "max_steps": "steps", "max_iters": "steps",
    "iters": "steps", "num_steps": "steps", "gradient_accumulation_steps": "grad_accum",
    "accumulation_steps": "grad_accum", "warmup": "warmup_steps", "warmup_iters": "warmup_steps",
    "max_grad_norm": "grad_clip", "clip": "grad_clip", "world_size": "nproc", "nprocs": "nproc",
    "num_processes": "nproc", "nproc_per_node": "nproc", "mixed_precision": "precision", "dtype": "precision",
    "cpu_offload": "offload", "gradient_checkpointing": "activation_checkpointing",
    "activation_checkpoint": "activation_checkpointing", "dataset": "data", "data_path": "data",
    "train_data": "data", "ckpt_dir": "checkpoint_dir", "out_dir": "checkpoint_dir", "save_dir": "checkpoint_dir",
    "save_every": "checkpoint_every", "ckpt_every": "checkpoint_every", "checkpoint_interval": "checkpoint_every",
    "sharding_strategy": "strategy", "min_learning_rate": "min_lr", "eval_interval": "log_every",
    "timeout": "watchdog_timeout", "watchdog": "watchdog_timeout", "nccl_timeout": "watchdog_timeout",
}


def synonym(key: str) -> str | None:
    """The key another trainer's name for it means (``max_iters`` -> ``steps``), if ``key`` is one."""
    return _SYNONYMS.get(key.strip().lower().replace("-", "_"))


def nearest_key(key: str) -> str | None:
    """The valid key a mistyped or foreign ``key`` most likely means."""
    names = [f.name for f in fields(TrainConfig)]
    norm = key.strip().lower().replace("-", "_")
    if norm in names:
        return norm
    if norm in _SYNONYMS:
        return _SYNONYMS[norm]
    close = difflib.get_close_matches(norm, names, n=1, cutoff=0.0)
    return close[0] if close else None


def _unknown_key(key: str, where: str) -> ConfigError:
    names = [f.name for f in fields(TrainConfig)]
    close = nearest_key(key)
    hint = f"; the nearest valid key is {close!r}" if close else ""
    return ConfigError(f"{where}: {key!r} is not a configuration key{hint}. Valid keys: {', '.join(names)}")


def _toml_module() -> Any:
    """``tomllib`` (Python >= 3.11), else ``tomli``, which pyproject.toml
    declares as a dependency on Python 3.10 (the same API under another name)."""
    if sys.version_info >= (3, 11):
        return importlib.import_module("tomllib")
    try:
        return importlib.import_module("tomli")
    except ImportError:
        raise ConfigError(
            "reading a TOML config on Python 3.10 needs the 'tomli' package (a dependency of shardwise there): "
            "run `pip install 'tomli>=1.1'` (or reinstall shardwise), or pass the settings as flags instead"
        ) from None


def load_toml(path: str | Path) -> dict[str, Any]:
    """The settings in a TOML file, flattened to ``{key: value}`` and checked
    against :class:`TrainConfig`'s keys (not yet their values).

    Args:
        path: the TOML file.
    """
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {str(path)!r} does not exist: pass the path of a TOML file")
    tomllib = _toml_module()
    try:
        raw = tomllib.loads(path.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"config file {str(path)!r} is not valid TOML: {exc}") from None
    sections = {f.name: f.metadata["section"] for f in fields(TrainConfig)}
    flat: dict[str, Any] = {}

    def put(key: str, value: Any, where: str) -> None:
        if key not in sections:
            raise _unknown_key(key, where)
        if key in flat:
            raise ConfigError(f"{where}: {key!r} is set twice in {str(path)!r}; keep one")
        flat[key] = value

    for key, value in raw.items():
        if isinstance(value, dict):
            if key not in SECTIONS:
                close = difflib.get_close_matches(key, SECTIONS, n=1, cutoff=0.0)
                raise ConfigError(
                    f"{str(path)!r}: [{key}] is not a section; the nearest valid one is [{close[0]}]. "
                    f"Sections: {', '.join(f'[{s}]' for s in SECTIONS)}"
                )
            for sub, sub_value in value.items():
                where = f"{str(path)!r} [{key}]"
                if sub in sections and sections[sub] != key:
                    raise ConfigError(f"{where}: {sub!r} belongs in [{sections[sub]}], not [{key}]; move it there")
                put(sub, sub_value, where)
        else:
            put(key, value, repr(str(path)))
    return flat


def resolve(toml_values: Mapping[str, Any], flag_values: Mapping[str, Any]) -> TrainConfig:
    """Defaults, overridden by the TOML values, overridden by the flags given.

    Args:
        toml_values: from :func:`load_toml` (may be empty).
        flag_values: the flags given on the command line, by field name.
    """
    values = {**toml_values, **flag_values}
    names = {f.name for f in fields(TrainConfig)}
    for key in values:
        if key not in names:
            raise _unknown_key(key, "configuration")
    return TrainConfig(**values)


def add_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per field of :class:`TrainConfig`; a flag not given is absent
    from the parsed namespace (so it does not override the TOML)."""
    groups = {s: parser.add_argument_group(f"[{s}]") for s in SECTIONS}
    for f in fields(TrainConfig):
        flag = "--" + f.name.replace("_", "-")
        default = f.default if f.default is not MISSING else None
        kw: dict[str, Any] = {"dest": f.name, "default": argparse.SUPPRESS,
                              "help": f"{f.metadata['help']} (default: {default!r})"}
        if f.metadata.get("choices"):
            kw["choices"] = f.metadata["choices"]
        group = groups[f.metadata["section"]]
        if isinstance(default, bool):
            group.add_argument(flag, action=argparse.BooleanOptionalAction, **kw)
        elif isinstance(default, tuple):
            group.add_argument(flag, nargs="+", metavar="PATH", **kw)
        elif "choices" in kw:
            group.add_argument(flag, type=type(default), **kw)
        else:
            group.add_argument(flag, type=type(default), metavar=f.name.upper(), **kw)


def config_from_flags(ns: argparse.Namespace) -> TrainConfig:
    """The configuration for a parsed ``shardwise train`` command line: its
    optional TOML file (``ns.config``) overridden by the flags given."""
    given = {f.name: getattr(ns, f.name) for f in fields(TrainConfig) if hasattr(ns, f.name)}
    toml_values = load_toml(ns.config) if getattr(ns, "config", None) else {}
    return resolve(toml_values, given)


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, tuple):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    return repr(value)


def render_toml(cfg: TrainConfig) -> str:
    """``cfg`` as a TOML document (by section) that :func:`load_toml` reads back."""
    lines: list[str] = []
    for section, items in cfg.section_items().items():
        lines.append(f"[{section}]")
        lines += [f"{key} = {_toml_value(value)}" for key, value in items.items()]
        lines.append("")
    return "\n".join(lines)


def as_dict(cfg: TrainConfig) -> dict[str, Any]:
    """``cfg`` as a plain dict (for checkpoints and metrics)."""
    return asdict(cfg)
