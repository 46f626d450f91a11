"""Checkpoint benchmark: shardwise.checkpoint vs. the same torch.distributed.checkpoint
calls on PyTorch's fully_shard.

Both configs train the same GPT (``shardwise.models``, the sizes of ``bench_step.py``) for
two AdamW steps on ``--nproc`` gloo ranks (default 2, CPU, one thread each), then time three
phases, each on every rank, in this order:

* ``save``   - shardwise: ``checkpoint.save(dir, model, optim)`` (DCP write, fsync, checksums,
  atomic commit).  torch_fsdp: ``dcp.save({"model": get_model_state_dict(m), "optim":
  get_optimizer_state_dict(m, o)}, checkpoint_id=dir)``, torchtitan's recipe.
* ``load``   - shardwise: ``checkpoint.load(dir, model, optim)`` (checks sizes and checksums,
  reads into fresh tensors, copies).  torch_fsdp: ``get_*_state_dict``, ``dcp.load`` in place,
  ``set_model_state_dict`` / ``set_optimizer_state_dict``.
* ``export`` - one unsharded safetensors file.  shardwise: ``checkpoint.export(file, model)``
  (all-gathers one group at a time, rank 0 streams it out).  torch_fsdp:
  ``get_model_state_dict(m, StateDictOptions(full_state_dict=True, cpu_offload=True))``
  (the whole model on rank 0), then ``safetensors.torch.save_file`` on rank 0 (tied weights
  cloned, as that function requires; shardwise's own writer if safetensors is missing).

Per phase and rank we record the wall time (the ranks start each phase together, after a
barrier) and the peak extra resident memory: a thread samples ``/proc/self/statm`` every
millisecond during the phase; the number is the peak minus the RSS at the phase's start
(freed heap memory is handed back to the OS first, ``malloc_trim``, so that a phase cannot
hide its allocations in pages an earlier phase freed).
The table shows, per config, the worst rank, as the median over ``--repeats`` runs (each a
freshly spawned set of ranks), and ratios shardwise / torch_fsdp (below 1: faster / less
memory).  Checkpoints go to a temporary directory under ``--dir`` (default: the system
temporary directory; page cache included, so this measures the software, not the disk).

Example: ``python benchmarks/bench_checkpoint.py --dim 512 --layers 8 --repeats 3``
"""

from __future__ import annotations

import os

os.environ["OMP_NUM_THREADS"] = "1"  # before torch is imported, here and in every rank

import argparse
import ctypes
import datetime
import importlib.util
import json
import shutil
import statistics
import sys
import tempfile
import threading
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

from shardwise.models import GPT, GPTConfig, synthetic_batch  # noqa: E402

CONFIGS = ("shardwise", "torch_fsdp")
BASELINE = "torch_fsdp"
PHASES = ("save", "load", "export")
MIB = 2**20
_PAGE = os.sysconf("SC_PAGE_SIZE")


def release_free_memory() -> None:
    """Hand freed heap memory back to the OS (glibc), so that a phase's new
    allocations show up in RSS instead of reusing an earlier phase's pages."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * _PAGE


class PeakRSS:
    """Context manager: peak RSS above the starting RSS, sampled every millisecond."""

    def __enter__(self) -> PeakRSS:
        self.start = rss_bytes()
        self.peak = self.start
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, rss_bytes())
            time.sleep(0.001)

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss_bytes())

    @property
    def extra_mib(self) -> float:
        return (self.peak - self.start) / MIB


def wrap(config: str, model: GPT, world_size: int) -> torch.nn.Module:
    from torch.distributed.device_mesh import init_device_mesh

    if config == "shardwise":
        from shardwise import fully_shard
    else:
        from torch.distributed.fsdp import fully_shard
    mesh = init_device_mesh("cpu", (world_size,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def phase_fns(config: str, model: torch.nn.Module, opt: torch.optim.Optimizer, out: Path) -> dict[str, Any]:
    """The three phases of one config, as zero-argument callables."""
    ckpt, file = out / "ckpt", out / "model.safetensors"
    if config == "shardwise":
        from shardwise import checkpoint

        return {
            "save": lambda: checkpoint.save(ckpt, model, opt),
            "load": lambda: checkpoint.load(ckpt, model, opt),
            "export": lambda: checkpoint.export(file, model),
        }

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    def save() -> None:
        state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
        dcp.save(state, checkpoint_id=str(ckpt))

    def load() -> None:
        state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
        dcp.load(state, checkpoint_id=str(ckpt))
        set_model_state_dict(model, state["model"])
        set_optimizer_state_dict(model, opt, state["optim"])

    def export() -> None:
        sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if dist.get_rank() == 0:
            try:
                from safetensors.torch import save_file
            except ImportError:
                from shardwise.checkpoint.safetensors_format import save_file  # type: ignore[assignment]
            seen: set[int] = set()
            unique = {}
            for k, v in sd.items():  # save_file refuses tensors that share memory
                unique[k] = v.clone() if v.data_ptr() in seen else v
                seen.add(v.data_ptr())
            save_file(unique, str(file))

    return {"save": save, "load": load, "export": export}


def worker(rank: int, config: str, args: argparse.Namespace, port: int, out_dir: str) -> None:
    """One rank of one config: train two steps, then time each phase; write ``rank{r}.json``."""
    torch.set_num_threads(1)
    out = Path(out_dir)
    result: dict[str, Any] = {}
    try:
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=args.nproc,
            timeout=datetime.timedelta(seconds=args.timeout),
        )
        cfg = GPTConfig(vocab_size=args.vocab, seq_len=args.seq_len, dim=args.dim,
                        n_layers=args.layers, n_heads=args.heads)
        torch.manual_seed(0)
        model = wrap(config, GPT(cfg), args.nproc)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        for step in range(2):
            x, y = synthetic_batch(cfg, args.batch_size, seed=step, rank=rank)
            GPT.loss(model(x), y).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        result["num_params"] = sum(p.numel() for p in model.parameters())
        fns = phase_fns(config, model, opt, out)
        for phase in PHASES:
            release_free_memory()
            dist.barrier()
            with PeakRSS() as peak:
                t0 = time.perf_counter()
                fns[phase]()
                elapsed = time.perf_counter() - t0
            result[f"{phase}_s"] = elapsed
            result[f"{phase}_mib"] = peak.extra_mib
        dist.barrier()
        if rank == 0:
            result["ckpt_mib"] = sum(f.stat().st_size for f in (out / "ckpt").iterdir()) / MIB
            result["file_mib"] = (out / "model.safetensors").stat().st_size / MIB
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
    tmp = tempfile.mkdtemp(prefix=f"bench_ckpt_{config}_", dir=args.dir)
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
    """Worst rank per run, then the median over runs."""
    good = [r for r in runs if "ranks" in r]
    if not good:
        return {"error": runs[0]["error"] if runs else "not run"}
    out: dict[str, Any] = {}
    for phase in PHASES:
        for unit in ("s", "mib"):
            key = f"{phase}_{unit}"
            out[key] = statistics.median(max(rk[key] for rk in r["ranks"]) for r in good)
    for key in ("ckpt_mib", "file_mib", "num_params"):
        out[key] = good[0]["ranks"][0][key]
    out["repeats_ok"] = len(good)
    return out


def format_table(summary: dict[str, dict[str, Any]]) -> str:
    head = ("phase", "config", "time ms", "peak extra MiB", "time/torch", "memory/torch")
    lines = ["{:<7} {:<11} {:>9} {:>15} {:>11} {:>13}".format(*head)]
    base = summary.get(BASELINE, {})
    for phase in PHASES:
        for config, s in summary.items():
            if "error" in s:
                lines.append(f"{phase:<7} {config:<11} {s['error'][:100]}")
                continue
            t, m = s[f"{phase}_s"], s[f"{phase}_mib"]
            bt, bm = base.get(f"{phase}_s"), base.get(f"{phase}_mib")
            rt = f"{t / bt:.2f}" if bt else "-"
            rm = f"{m / bm:.2f}" if bm and bm > 0.5 else "-"
            lines.append(f"{phase:<7} {config:<11} {1e3 * t:>9.1f} {m:>15.1f} {rt:>11} {rm:>13}")
    any_ok = next((s for s in summary.values() if "error" not in s), None)
    if any_ok:
        lines.append(
            f"({any_ok['num_params'] / 1e6:.2f} M parameters; sharded checkpoint {any_ok['ckpt_mib']:.1f} MiB "
            f"with AdamW state; exported file {any_ok['file_mib']:.1f} MiB)"
        )
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated subset of %(default)s")
    p.add_argument("--nproc", type=int, default=2, help="world size")
    p.add_argument("--repeats", type=int, default=3, help="runs of the whole set; median reported")
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=4, help="per rank")
    p.add_argument("--dir", default=None, help="where checkpoints are written (default: system temp dir)")
    p.add_argument("--timeout", type=float, default=600, help="collective timeout, seconds")
    p.add_argument("--json", type=Path, help="also write all results to this file")
    args = p.parse_args(argv)
    args.configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = sorted(set(args.configs) - set(CONFIGS))
    if unknown or not args.configs:
        p.error(f"--configs: unknown {unknown}; choose from {','.join(CONFIGS)}")
    if args.nproc < 1 or args.repeats < 1:
        p.error("--nproc and --repeats must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    print(
        f"GPT dim={args.dim} layers={args.layers} heads={args.heads} seq={args.seq_len} vocab={args.vocab}; "
        f"{args.nproc} ranks (gloo, CPU, 1 thread each); {args.repeats} repeat(s); torch {torch.__version__}",
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
