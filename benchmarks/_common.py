"""What the benchmark scripts share: a free port for each set of ranks, the
repeat loop over configurations, and the JSON record."""

from __future__ import annotations

import argparse
import json
import socket
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    """Return a TCP port on 127.0.0.1 that is free right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def write_rank_result(out: Path, measure: Callable[[], dict[str, Any]]) -> None:
    """Run one rank's ``measure()`` and write its result, or its error with
    the time it happened (``spawn_ranks`` reports the earliest), to ``out``;
    the process group is destroyed either way."""
    try:
        result = measure()
    except BaseException as exc:
        out.write_text(json.dumps({"error": f"{type(exc).__name__}: {exc}".strip(), "t": time.time()}))
        traceback.print_exc()
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    out.write_text(json.dumps(result))


def spawn_ranks(worker: Callable[..., None], config: str, args: argparse.Namespace) -> dict[str, Any]:
    """Run ``worker(rank, config, args, port, out_dir)`` on ``args.nproc`` fresh
    processes; each writes ``rank{r}.json`` (with ``error`` and its time ``t``
    on failure). Returns ``{"ranks": [...]}`` or ``{"error": ...}``, the
    earliest error (later ones are usually peers losing their link)."""
    with tempfile.TemporaryDirectory(prefix=f"bench_{config}_") as tmp:
        try:
            mp.spawn(worker, args=(config, args, free_port(), tmp), nprocs=args.nproc, join=True)
        except Exception as exc:  # noqa: BLE001 - report, and go on with the next config
            errors = [json.loads(f.read_text()) for f in Path(tmp).glob("rank*.json")]
            errors = sorted((e for e in errors if "error" in e), key=lambda e: e.get("t", 0.0))
            msg = errors[0]["error"] if errors else f"{type(exc).__name__}: {exc}"
            return {"error": f"failed: {(msg.splitlines() or ['?'])[0]}"}
        return {"ranks": [json.loads((Path(tmp) / f"rank{r}.json").read_text()) for r in range(args.nproc)]}


def run_repeats(
    args: argparse.Namespace, run_config: Callable[[str, argparse.Namespace], dict[str, Any]]
) -> dict[str, list[dict[str, Any]]]:
    """Run every config ``args.repeats`` times, interleaved (so that machine
    noise spreads over all of them); a config that failed is not retried."""
    runs: dict[str, list[dict[str, Any]]] = {c: [] for c in args.configs}
    for rep in range(args.repeats):
        for config in args.configs:
            if runs[config] and "error" in runs[config][-1]:
                continue
            t0 = time.perf_counter()
            runs[config].append(run_config(config, args))
            status = runs[config][-1].get("error", "ok")
            print(f"  repeat {rep + 1}/{args.repeats} {config}: {status} "
                  f"({time.perf_counter() - t0:.1f} s)", flush=True)
    return runs


def write_json(path: Path, args: argparse.Namespace, summary: dict[str, Any], runs: dict[str, Any]) -> None:
    """The arguments, torch version, summary and every run, as JSON."""
    path.write_text(json.dumps(
        {"args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
         "torch": torch.__version__, "summary": summary, "runs": runs}, indent=2))
