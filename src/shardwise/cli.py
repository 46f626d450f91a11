"""The ``shardwise`` command (also ``python -m shardwise``).

``shardwise train [config.toml] [--flags]`` trains a GPT-style model with
``fully_shard`` on ``--nproc`` local ranks, or as one rank of a ``torchrun``
launch (one node or many: the same code path). Flags override the TOML file;
``shardwise train --help`` lists them all. Every configuration mistake is
reported before any rank starts, as ``shardwise train: error: ...`` with exit
status 2.

``shardwise plan [config.toml] [the same flags]`` runs the configured
training step under fake tensors at ``--nproc`` ranks and reports each rank's
memory and each step's communication (``--json FILE`` for tools).
"""

from __future__ import annotations

import argparse
import difflib
import os
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, NoReturn

if TYPE_CHECKING:
    from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

    from shardwise.train.config import TrainConfig

__all__ = ["main"]

_EPILOG = """\
examples:
  shardwise train                                  # 2 local ranks, Python's own text, ~2 minutes on 2 cores
  shardwise train run.toml --steps 1000 --plot loss.png
  shardwise train --data my.txt --strategy shard-grad-op --precision bf16 --dry-run
  torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST:29500 \\
      -m shardwise train run.toml --device cuda
"""


_PLAN_EPILOG = """\
examples:
  shardwise plan --nproc 8 --precision bf16       # the built-in GPT on 8 ranks, a few seconds
  shardwise plan --model hf --hf-config benchmarks/configs/llama3-405b.json --nproc 16384 \\
      --precision bf16 --seq-len 8192 --batch-size 16384 --json plan.json
"""


def _parser() -> argparse.ArgumentParser:
    from shardwise.train.config import add_flags

    parser = argparse.ArgumentParser(prog="shardwise", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser(
        "train", help="sharded training of a GPT-style model (local ranks or torchrun)",
        description="Sharded (FSDP / ZeRO-3) training of a GPT-style model. Settings come from the defaults, "
                    "then the TOML file, then the flags; TOML keys are the flag names with underscores.",
        epilog=_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    train.add_argument("config", nargs="?", default=None, metavar="config.toml",
                       help="a TOML file of settings (keys at the top level or under [model], [parallel], "
                            "[optim], [data], [checkpoint], [output])")
    add_flags(train)
    plan = sub.add_parser(
        "plan", help="each rank's memory and communication for a training run, before it runs",
        description="Run one real training step (two, the first making the optimizer state) of the configured "
                    "model under fake tensors and a fake process group at --nproc ranks, allocating nothing, and "
                    "report each rank's peak memory by category and each step's communication. Takes the same "
                    "settings as `shardwise train` (the data is not read: the step trains on random tokens).",
        epilog=_PLAN_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    plan.add_argument("config", nargs="?", default=None, metavar="config.toml", help="a TOML file of settings")
    plan.add_argument("--json", default="", metavar="FILE", help="also write the figures to FILE as JSON")
    plan.add_argument("--rank", type=int, action="append", default=None, metavar="R",
                      help="plan only rank R (repeatable); default: every rank")
    plan.add_argument("--every-layer", action="store_true",
                      help="run every repeated layer instead of 3 and 4 counted on to the full number")
    add_flags(plan)
    return parser


def _unknown_arguments(parser: argparse.ArgumentParser, command: str, extra: list[str]) -> str:
    """The message for arguments ``command`` does not take: the first unknown flag and the nearest valid one."""
    from shardwise.train.config import nearest_key, synonym

    sub = next(a.choices[command] for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    flags = [o for a in sub._actions for o in a.option_strings if o.startswith("--")]
    word = next((w for w in extra if w.startswith("-")), None)
    if word is None:
        return (f"unexpected argument {extra[0]!r}: `shardwise {command}` takes at most one config.toml; "
                "settings are flags (see --help)")
    name = word.split("=", 1)[0]
    known = synonym(name.lstrip("-").removeprefix("no-"))
    close = difflib.get_close_matches(name, flags, n=1, cutoff=0.6)
    nearest = "--" + known.replace("_", "-") if known else close[0] if close else None
    if nearest is None:  # another trainer's name (--learning-rate), else the least far one
        key = nearest_key(name.lstrip("-").removeprefix("no-"))
        nearest = "--" + key.replace("_", "-") if key is not None else None
        if nearest not in flags:
            close = difflib.get_close_matches(name, flags, n=1, cutoff=0.0)
            nearest = close[0] if close else None
    if nearest is not None and name.startswith("--no-") and "--no-" + nearest[2:] in flags:
        nearest = "--no-" + nearest[2:]
    hint = f"; the nearest valid flag is {nearest}" if nearest else ""
    return f"unknown flag {name}{hint} (`shardwise {command} --help` lists them all)"


def _fail(message: str, code: int, command: str = "train") -> NoReturn:
    # Under torchrun every rank finds the same mistake; one message is enough.
    if os.environ.get("RANK", "0") == "0":
        print(f"shardwise {command}: error: {message}", file=sys.stderr, flush=True)
    raise SystemExit(code)


def plan_command(ns: argparse.Namespace) -> None:
    """``shardwise plan``: print (and with ``--json`` write) :func:`shardwise.train.plan.plan_training`'s result."""
    from shardwise.errors import ShardwiseError
    from shardwise.train.config import config_from_flags
    from shardwise.train.plan import plan_training, print_plan, write_json

    try:
        cfg = config_from_flags(ns)
        result = plan_training(cfg, ranks=ns.rank, repeat=not ns.every_layer)
    except (ShardwiseError, ValueError, TypeError) as exc:
        _fail(str(exc), 2, "plan")
    print_plan(result, sys.stdout)
    if ns.json:
        write_json(result, ns.json)
        print(f"\nwrote {ns.json}")


def _train_config(ns: argparse.Namespace) -> TrainConfig:
    """``shardwise train``'s settings from the parsed flags (and TOML file), or exit 2 naming the mistake."""
    from shardwise.errors import ShardwiseError
    from shardwise.train.config import config_from_flags

    try:
        return config_from_flags(ns)
    except (ShardwiseError, ValueError, TypeError) as exc:
        _fail(str(exc), 2)


def train_command(cfg: TrainConfig) -> None:
    """Check and run ``shardwise train`` with settings ``cfg``."""
    from shardwise.errors import ShardwiseError
    from shardwise.train.launch import dry_run, preflight, torchrun_world
    from shardwise.train.loop import launch
    from shardwise.train.report import console_logging
    from shardwise.train.supervise import RunFailed

    try:
        # the library logs, the command shows: --log-level (under torchrun, this process is rank RANK)
        console_logging(cfg.log_level, rank=int(os.environ["RANK"]) if "RANK" in os.environ else None)
        plan = preflight(cfg, torchrun_world(cfg))
        if cfg.dry_run:
            if plan.world.rank == 0:
                dry_run(plan)
            return
    except (ShardwiseError, ValueError, TypeError) as exc:
        _fail(str(exc), 2)
    try:
        launch(plan)
    except RunFailed as exc:  # one message, whichever way a rank failed; under torchrun in the error file too
        _error_handler().record_exception(exc)
        _fail(str(exc), exc.exit_code)
    except KeyboardInterrupt:
        _fail("interrupted", 130)


def _error_handler() -> ErrorHandler:
    """torchelastic's error handler, except that it turns on the fault handler
    only where stderr is a file (``main()`` called in-process, e.g. under
    pytest's capture, would otherwise warn "Unable to enable fault handler")."""
    from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

    class _QuietErrorHandler(ErrorHandler):
        def initialize(self) -> None:
            try:
                sys.stderr.fileno()
            except (AttributeError, OSError, ValueError):
                return
            super().initialize()

    return _QuietErrorHandler()


def main(argv: list[str] | None = None) -> None:
    """Entry point of the ``shardwise`` console script and ``python -m shardwise``.

    Under ``torchrun`` (which sets ``TORCHELASTIC_ERROR_FILE``) an exception that
    ends this rank is written to that file (torchelastic's ``@record``), so
    torchrun's failure report names the first failing rank's exception and
    traceback.

    A local ``shardwise train`` starts its ranks' fork server as soon as the
    settings are checked, before this process imports torch: the server's
    import of torch and this process's then run at once
    (:mod:`shardwise.train.ranks`).

    Args:
        argv: the arguments (without the program name). (Default: ``None``: ``sys.argv[1:]``)
    """
    parser = _parser()
    ns, extra = parser.parse_known_args(argv)
    if extra:
        _fail(_unknown_arguments(parser, ns.command, extra), 2, ns.command)
    if ns.command == "train":
        from shardwise.train.ranks import start_server, stop_server, under_torchrun

        cfg = _train_config(ns)
        started = not cfg.dry_run and not under_torchrun() and start_server(cfg.nproc)
        try:
            _recorded(train_command)(cfg)
        except BaseException:
            if started:  # a check refused the run, say: no server left importing torch for nothing
                stop_server()
            raise
    elif ns.command == "plan":
        _recorded(plan_command)(ns)


def _recorded(command: Callable[..., None]) -> Callable[..., None]:
    """``command`` under torchelastic's ``@record`` (see :func:`main`)."""
    from torch.distributed.elastic.multiprocessing.errors import record

    return record(command, error_handler=_error_handler())


if __name__ == "__main__":
    main(sys.argv[1:])
