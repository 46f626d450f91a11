"""What the watchdog (``shardwise.watchdog``) costs a training step.

Two measurements:

* ``--mode loop`` (default): ``--nproc`` gloo ranks (CPU, one thread each)
  train a GPT (``shardwise.models``; ``fully_shard`` per block and the root)
  with AdamW on synthetic batches, alternating blocks of ``--steps`` steps
  without and with a running :class:`~shardwise.watchdog.Watchdog` (its
  observer on every engine region, its thread publishing to the store), for
  ``--repeats`` rounds in one set of processes; per round, the median step
  time of each, worst rank; then the median over rounds of the ratio
  on / off. Alternating inside one process keeps the machine's drift out of
  the ratio.
* ``--mode cli``: ``shardwise train`` end to end, ``--watchdog-timeout 0`` vs
  the default, ``--repeats`` times each, alternating; the throughput of the
  "done:" line (every step but the first).

Both run on a shared machine: a few percent of noise either way is normal,
so read a ratio within it as "no measurable cost".

Example: ``python benchmarks/bench_watchdog.py --steps 40 --repeats 3``
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import free_port  # noqa: E402


def _worker(rank: int, args: argparse.Namespace, port: int, out: str) -> None:
    from shardwise import fully_shard
    from shardwise.models import GPT, GPTConfig, synthetic_batch
    from shardwise.watchdog import Watchdog

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, args.nproc, rank == 0)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=args.nproc)
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=256, seq_len=args.seq_len, dim=args.dim, n_layers=args.layers, n_heads=4)
    model = GPT(cfg)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = synthetic_batch(cfg, args.batch, seed=rank)

    def steps(n: int, wd: Watchdog | None) -> list[float]:
        times = []
        for i in range(n):
            dist.barrier()
            t0 = time.perf_counter()
            if wd is not None:
                wd.step(i)
            loss = GPT.loss(model(x), y)
            loss.backward()
            optim.step()
            optim.zero_grad(set_to_none=True)
            times.append(time.perf_counter() - t0)
        return times

    steps(3, None)  # warm-up
    # the training thread's own cost, apart from the noise: engine events per step x cost per event
    from shardwise._engine.trace import trace

    with Watchdog(timeout=300) as wd:
        before = wd._events
        steps(1, wd)
        events = wd._events - before

    def per_region(n: int = 20000) -> float:
        t0 = time.perf_counter()
        for _ in range(n):
            with trace("shardwise::all_gather (blocks.0)"):
                pass
        return (time.perf_counter() - t0) / n

    bare = min(per_region() for _ in range(5))
    with Watchdog(timeout=300):
        watched = min(per_region() for _ in range(5))
    rounds = []
    for _ in range(args.repeats):
        off = statistics.median(steps(args.steps, None))
        with Watchdog(timeout=300) as wd:
            on = statistics.median(steps(args.steps, wd))
        rounds.append({"off": off, "on": on})
    Path(out, f"rank{rank}.json").write_text(json.dumps({"rounds": rounds, "events": events, "bare": bare,
                                                        "watched": watched}))
    dist.destroy_process_group()


def loop_mode(args: argparse.Namespace) -> dict[str, object]:
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_worker, args=(args, free_port(), tmp), nprocs=args.nproc, join=True)
        ranks = [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(args.nproc)]
    rounds = [{k: max(rk["rounds"][i][k] for rk in ranks) for k in ("off", "on")} for i in range(args.repeats)]
    ratios = [r["on"] / r["off"] for r in rounds]
    for i, r in enumerate(rounds):
        print(f"round {i}: step {r['off'] * 1e3:.2f} ms without, {r['on'] * 1e3:.2f} ms with the watchdog "
              f"(x{r['on'] / r['off']:.4f})")
    print(f"median ratio with / without: {statistics.median(ratios):.4f}")
    r0 = ranks[0]
    regions = r0["events"] // 2  # an event on entering and one on leaving each region (and a few for steps)
    extra = regions * (r0["watched"] - r0["bare"])
    step = statistics.median(r["off"] for r in rounds)
    print(f"training thread: about {regions} engine regions per step x {(r0['watched'] - r0['bare']) * 1e6:.2f} us "
          f"more each (a region costs {r0['bare'] * 1e6:.2f} us unwatched, {r0['watched'] * 1e6:.2f} us watched) = "
          f"{extra * 1e6:.0f} us per step, {extra / step:.3%} of the median step")
    return {"rounds": rounds, "median_ratio": statistics.median(ratios), "events_per_step": r0["events"],
            "region_bare_s": r0["bare"], "region_watched_s": r0["watched"], "thread_cost_fraction": extra / step}


def cli_mode(args: argparse.Namespace) -> dict[str, object]:
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": str(root / "src") + os.pathsep + os.environ.get("PYTHONPATH", "")}
    base = [sys.executable, "-m", "shardwise", "train", "--nproc", str(args.nproc), "--steps", str(args.steps),
            "--dim", str(args.dim), "--n-layers", str(args.layers), "--seq-len", str(args.seq_len),
            "--batch-size", str(args.batch * args.nproc), "--log-every", str(args.steps)]
    rates: dict[str, list[float]] = {"off": [], "on": []}
    for _ in range(args.repeats):
        for name, flag in (("off", "0"), ("on", "300")):
            out = subprocess.run([*base, "--watchdog-timeout", flag], env=env, capture_output=True, text=True,
                                 check=True).stdout
            rate = float(re.search(r"\| ([\d,]+) tok/s", out.split("done:")[1]).group(1).replace(",", ""))
            rates[name].append(rate)
            print(f"watchdog {name}: {rate:,.0f} tok/s")
    ratio = statistics.median(rates["off"]) / statistics.median(rates["on"])
    print(f"step time with / without (median throughput ratio): {ratio:.4f}")
    return {"rates": rates, "ratio": ratio}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mode", choices=("loop", "cli"), default="loop")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8, help="sequences per rank per step")
    parser.add_argument("--json", default="", help="also write the figures here")
    args = parser.parse_args()
    result = loop_mode(args) if args.mode == "loop" else cli_mode(args)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
