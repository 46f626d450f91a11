"""How long the training loop is blocked by a checkpoint: ``checkpoint.save``
blocking vs ``checkpoint.save(..., async_mode=True)``.

Each config spawns ``--nproc`` fresh gloo ranks (CPU, one thread each) that
train a GPT (``shardwise.models``, ``fully_shard`` per block and the root;
default about 55 M parameters: dim 512, 16 layers, vocabulary 8192, tied
embeddings) with AdamW, and save a sharded checkpoint (model + AdamW state)
every ``--steps-between`` steps, ``--saves`` times, after one untimed warm-up
save (one-time costs: DCP's planner caches, the background saves' gloo group).

Blocked time per save, per rank:

* ``blocking``: the time inside ``checkpoint.save`` (state dicts, DCP write
  with fsync, checksums, commit).
* ``async``: the time inside ``checkpoint.save(..., async_mode=True)`` (state
  dicts, the copy to fresh CPU tensors, rank 0's staging directory) plus the
  time the loop then waits for that save to finish when the next one is due
  (``handle.wait()`` before the next save; after the last one, as at the end
  of training): zero when the background write fits in the steps between.

Also reported: the background write's own duration (save returned -> committed,
measured after the timed saves, with nothing else running), and the mean
training step time of each config (the async one's steps run while the write
goes on, on the same cores). The table shows, per config, the worst
rank of each save, as the median over all saves of all ``--repeats`` runs, and
the ratio async / blocking. Checkpoints go to a temporary directory under
``--dir`` (default: the system temporary directory).

Example: ``python benchmarks/bench_async_checkpoint.py`` (``--dim 256 --layers 4``
for a quick run).
"""

from __future__ import annotations

import os

os.environ["OMP_NUM_THREADS"] = "1"  # before torch is imported, here and in every rank

import argparse
import datetime
import importlib.util
import json
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from _common import free_port, run_repeats, write_json

SRC = Path(__file__).resolve().parents[1] / "src"
if importlib.util.find_spec("shardwise") is None:  # not pip-installed: use the source tree
    sys.path.insert(0, str(SRC))

from shardwise import checkpoint, fully_shard  # noqa: E402
from shardwise.models import GPT, GPTConfig, synthetic_batch  # noqa: E402

CONFIGS = ("blocking", "async")
MIB = 2**20


def worker(rank: int, config: str, args: argparse.Namespace, port: int, out_dir: str) -> None:
    """One rank: train, save ``args.saves`` times; write ``rank{r}.json``."""
    torch.set_num_threads(1)
    out = Path(out_dir)
    result: dict[str, Any] = {"blocked_s": [], "background_s": [], "step_s": []}
    try:
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=args.nproc,
            timeout=datetime.timedelta(seconds=args.timeout),
        )
        cfg = GPTConfig(vocab_size=args.vocab, seq_len=args.seq_len, dim=args.dim, n_layers=args.layers,
                        n_heads=args.heads)
        torch.manual_seed(0)
        model = GPT(cfg)
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        result["num_params"] = sum(p.numel() for p in model.parameters())
        step = 0

        def train() -> float:
            nonlocal step
            t0 = time.perf_counter()
            x, y = synthetic_batch(cfg, args.batch_size, seed=step, rank=rank)
            GPT.loss(model(x), y).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            step += 1
            return time.perf_counter() - t0

        for _ in range(2):
            train()
        checkpoint.save(out / "warmup", model, opt)  # untimed: one-time costs
        if config == "async":
            checkpoint.save(out / "warmup-async", model, opt, async_mode=True).wait()
        root = out / "ckpt"
        pending: checkpoint.AsyncSave | None = None
        for _ in range(args.saves):
            dist.barrier()
            if pending is not None:  # the next save is due: wait for the previous one (what save() would do)
                t0 = time.perf_counter()
                pending.wait()
                result["blocked_s"][-1] += time.perf_counter() - t0
            t0 = time.perf_counter()
            if config == "async":
                pending = checkpoint.save(root, model, opt, step=step, async_mode=True, keep=2)
            else:
                checkpoint.save(root, model, opt, step=step, keep=2)
            result["blocked_s"].append(time.perf_counter() - t0)
            for _ in range(args.steps_between):
                result["step_s"].append(train())
        if pending is not None:  # the end of training waits for the last one
            t0 = time.perf_counter()
            pending.wait()
            result["blocked_s"][-1] += time.perf_counter() - t0
            # the background write alone, nothing else running: save returned -> committed
            for _ in range(args.saves):
                dist.barrier()
                handle = checkpoint.save(root, model, opt, step=step, async_mode=True, overwrite=True)
                t0 = time.perf_counter()
                handle.wait()
                result["background_s"].append(time.perf_counter() - t0)
        dist.barrier()
        if rank == 0:
            latest = checkpoint.latest(root)
            result["ckpt_mib"] = sum(f.stat().st_size for f in latest.iterdir()) / MIB if latest else 0.0
    except BaseException as exc:
        (out / f"rank{rank}.json").write_text(json.dumps({"error": f"{type(exc).__name__}: {exc}", "t": time.time()}))
        traceback.print_exc()
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    (out / f"rank{rank}.json").write_text(json.dumps(result))


def run_config(config: str, args: argparse.Namespace) -> dict[str, Any]:
    """Spawn fresh ranks for one config; return per-rank results or an ``error``."""
    tmp = tempfile.mkdtemp(prefix=f"bench_async_ckpt_{config}_", dir=args.dir)
    try:
        try:
            mp.spawn(worker, args=(config, args, free_port(), tmp), nprocs=args.nproc, join=True)
        except Exception as exc:  # noqa: BLE001 - report, go on with the next config
            errors = [json.loads(f.read_text()) for f in Path(tmp).glob("rank*.json")]
            errors = sorted((e for e in errors if "error" in e), key=lambda e: e["t"])
            msg = errors[0]["error"] if errors else f"{type(exc).__name__}: {exc}"
            return {"error": f"failed: {(msg.splitlines() or ['?'])[0]}"}
        return {"ranks": [json.loads((Path(tmp) / f"rank{r}.json").read_text()) for r in range(args.nproc)]}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def summarise(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Worst rank per save, then the median over every save of every run."""
    good = [r for r in runs if "ranks" in r]
    if not good:
        return {"error": runs[0]["error"] if runs else "not run"}
    out: dict[str, Any] = {}
    for key in ("blocked_s", "background_s"):
        per_save = [max(rk[key][i] for rk in r["ranks"]) for r in good for i in range(len(r["ranks"][0][key]))]
        out[key] = statistics.median(per_save) if per_save else 0.0
        out[f"{key}_all"] = per_save
    out["step_s"] = statistics.mean(statistics.mean(rk["step_s"]) for r in good for rk in r["ranks"])
    out["ckpt_mib"] = good[0]["ranks"][0]["ckpt_mib"]
    out["num_params"] = good[0]["ranks"][0]["num_params"]
    out["repeats_ok"] = len(good)
    return out


def format_table(summary: dict[str, dict[str, Any]]) -> str:
    head = ("config", "blocked ms/save", "x blocking", "write ms (bg)", "step ms", "blocked each save (ms)")
    lines = ["{:<9} {:>15} {:>10} {:>13} {:>8}  {}".format(*head)]
    base = summary.get("blocking", {}).get("blocked_s")
    for config, s in summary.items():
        if "error" in s:
            lines.append(f"{config:<9} {s['error'][:100]}")
            continue
        ratio = f"{s['blocked_s'] / base:.3f}" if base else "-"
        background = f"{1e3 * s['background_s']:.0f}" if s["background_s_all"] else "-"
        each = " ".join(f"{1e3 * v:.0f}" for v in s["blocked_s_all"])
        lines.append(f"{config:<9} {1e3 * s['blocked_s']:>15.1f} {ratio:>10} {background:>13} "
                     f"{1e3 * s['step_s']:>8.0f}  {each}")
    any_ok = next((s for s in summary.values() if "error" not in s), None)
    if any_ok:
        lines.append(f"({any_ok['num_params'] / 1e6:.1f} M parameters; a checkpoint with AdamW state is "
                     f"{any_ok['ckpt_mib']:.0f} MiB over all ranks)")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated subset of %(default)s")
    p.add_argument("--nproc", type=int, default=2, help="world size")
    p.add_argument("--repeats", type=int, default=3, help="runs of the whole set (fresh ranks each)")
    p.add_argument("--saves", type=int, default=3, help="timed saves per run")
    p.add_argument("--steps-between", type=int, default=4, help="training steps between two saves")
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--batch-size", type=int, default=1, help="sequences per rank per step")
    p.add_argument("--dir", default=None, help="where checkpoints are written (default: system temp dir)")
    p.add_argument("--timeout", type=float, default=600, help="collective timeout, seconds")
    p.add_argument("--json", type=Path, help="also write all results to this file")
    args = p.parse_args(argv)
    args.configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = sorted(set(args.configs) - set(CONFIGS))
    if unknown or not args.configs:
        p.error(f"--configs: unknown {unknown}; choose from {','.join(CONFIGS)}")
    if args.nproc < 1 or args.repeats < 1 or args.saves < 1:
        p.error("--nproc, --repeats and --saves must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    print(
        f"GPT dim={args.dim} layers={args.layers} heads={args.heads} seq={args.seq_len} vocab={args.vocab}; "
        f"{args.nproc} ranks (gloo, CPU, 1 thread each); {args.saves} saves {args.steps_between} steps apart; "
        f"{args.repeats} repeat(s); torch {torch.__version__}",
        flush=True,
    )
    runs = run_repeats(args, run_config)
    summary = {c: summarise(r) for c, r in runs.items()}
    print(format_table(summary))
    if args.json:
        write_json(args.json, args, summary, runs)
    return 1 if any("error" in s for s in summary.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
