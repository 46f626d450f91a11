"""Mixed-dtype groups benchmark: a LoRA model whose bf16 weights and fp32
adapters (rank 4) all train, sharded three ways, in one launch:

* ``shardwise_together`` - shardwise: each block (bf16 weights and fp32
  adapters together) is one ``fully_shard`` group, then the root;
* ``shardwise_separate`` - shardwise with the workaround PyTorch needs: every
  adapter pair wrapped in its own ``fully_shard`` (so each group's trainable
  parameters share one dtype), then the blocks, then the root;
* ``shardwise_per_dtype`` - as ``shardwise_together``, but each group gathers
  its two dtypes in two all-gathers (``GroupSettings.all_gather_per_dtype``,
  an engine knob) instead of one packed byte buffer;
* ``torch_separate`` - PyTorch's ``fully_shard`` with that same workaround
  (PyTorch 2.13 refuses the ``together`` layout: "FSDP expects uniform
  original parameter dtype").

Per config: the median step time (forward, backward, AdamW step) over
``--steps`` after ``--warmup``, worst rank, median of ``--repeats`` runs; and
the collectives one step issues (counted in an extra, untimed step), by kind.
CPU, gloo, one thread per rank. Example:
``python benchmarks/bench_mixed_dtype.py --nproc 2 --repeats 3``
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import os
import statistics
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from _common import run_repeats, spawn_ranks, write_json, write_rank_result
from torch.utils._python_dispatch import TorchDispatchMode

SRC = Path(__file__).resolve().parents[1] / "src"
if importlib.util.find_spec("shardwise") is None:  # not pip-installed: use the source tree
    sys.path.insert(0, str(SRC))

CONFIGS = ("shardwise_together", "shardwise_per_dtype", "shardwise_separate", "torch_separate")
BASELINE = "torch_separate"


class LoRA(nn.Module):
    """The fp32 adapter pair: x A^T B^T."""

    def __init__(self, d_in: int, d_out: int, rank: int) -> None:
        super().__init__()
        self.a = nn.Linear(d_in, rank, bias=False)
        self.b = nn.Linear(rank, d_out, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x))


class LoRALinear(nn.Module):
    def __init__(self, d_in: int, d_out: int, rank: int) -> None:
        super().__init__()
        self.base = nn.Linear(d_in, d_out).to(torch.bfloat16)
        self.lora = LoRA(d_in, d_out, rank)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x.to(torch.bfloat16)).float() + self.lora(x)


class Block(nn.Module):
    def __init__(self, dim: int, rank: int) -> None:
        super().__init__()
        self.up = LoRALinear(dim, 4 * dim, rank)
        self.down = LoRALinear(4 * dim, dim, rank)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(x)))


class Net(nn.Module):
    def __init__(self, dim: int, layers: int, rank: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(dim, rank) for _ in range(layers))
        self.head = LoRALinear(dim, dim, rank)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class CountCollectives(TorchDispatchMode):
    """Counts c10d collectives issued inside it, by op name."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if func.namespace == "c10d":
            self.counts[func.__name__.split(".")[0].strip("_")] += 1
        return func(*args, **(kwargs or {}))


def shard(config: str, model: Net) -> None:
    if config.startswith("shardwise"):
        from shardwise import fully_shard
    else:
        from torch.distributed.fsdp import fully_shard
    separate = config.endswith("_separate")
    for block in model.blocks:
        if separate:
            for m in block.modules():
                if isinstance(m, LoRA):
                    fully_shard(m)
        fully_shard(block)
    if separate:
        fully_shard(model.head.lora)
    fully_shard(model)
    if config == "shardwise_per_dtype":
        for m in model.modules():
            state = getattr(m, "_get_fsdp_state", None)
            if state is not None:
                for group in state().groups:
                    group.settings.all_gather_per_dtype = True


def worker(rank: int, config: str, args: argparse.Namespace, port: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    write_rank_result(Path(out_dir) / f"rank{rank}.json", lambda: _measure(rank, config, args, port))


def _measure(rank: int, config: str, args: argparse.Namespace, port: int) -> dict[str, Any]:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=args.nproc, timeout=datetime.timedelta(seconds=600))
    torch.manual_seed(0)
    model = Net(args.dim, args.layers, args.rank)
    shard(config, model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(args.tokens, args.dim, generator=g)
    y = torch.randn(args.tokens, args.dim, generator=g)

    def step() -> float:
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        return time.perf_counter() - t0

    times = [step() for _ in range(args.warmup + args.steps)][args.warmup:]
    with CountCollectives() as counter:
        step()
    result = {"step_ms": 1e3 * statistics.median(times), "collectives": dict(counter.counts)}
    result["collectives_total"] = sum(counter.counts.values())
    return result


def run_config(config: str, args: argparse.Namespace) -> dict[str, Any]:
    return spawn_ranks(worker, config, args)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", default=",".join(CONFIGS))
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--rank", type=int, default=4, help="LoRA rank")
    p.add_argument("--tokens", type=int, default=512, help="rows per rank per step")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    args.configs = [c for c in args.configs.split(",") if c]
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    print(f"LoRA net dim={args.dim} layers={args.layers} rank={args.rank} tokens={args.tokens}/rank; "
          f"{args.nproc} ranks (gloo, CPU); bf16 weights + fp32 adapters, all trainable; "
          f"{args.warmup} warmup + {args.steps} timed steps; {args.repeats} repeat(s); torch {torch.__version__}",
          flush=True)
    runs = run_repeats(args, run_config)
    summary: dict[str, Any] = {}
    for config, results in runs.items():
        good = [r for r in results if "ranks" in r]
        if not good:
            summary[config] = {"error": results[0]["error"] if results else "not run"}
            continue
        summary[config] = {
            "step_ms": statistics.median(max(rk["step_ms"] for rk in r["ranks"]) for r in good),
            "collectives": good[0]["ranks"][0]["collectives"],
            "collectives_total": good[0]["ranks"][0]["collectives_total"],
        }
    base = summary.get(BASELINE, {})
    print(f"{'config':<20} {'step ms':>9} {'step/torch':>11} {'collectives/step':>17}  by kind")
    for config, s in summary.items():
        if "error" in s:
            print(f"{config:<20} {s['error'][:100]}")
            continue
        ratio = f"{s['step_ms'] / base['step_ms']:.2f}" if "step_ms" in base else "-"
        kinds = ", ".join(f"{k} {v}" for k, v in sorted(s["collectives"].items()))
        print(f"{config:<20} {s['step_ms']:>9.1f} {ratio:>11} {s['collectives_total']:>17}  {kinds}")
    if args.json:
        write_json(args.json, args, summary, runs)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
