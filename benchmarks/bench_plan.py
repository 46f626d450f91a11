"""``shardwise plan`` checked against measurement, and at scale.

1. Accuracy: for several training configurations at world sizes 1, 2 and 4,
   the planner's peak of live tensor bytes per rank (the real step under fake
   tensors and the fake process group) against the same step run for real
   on gloo ranks under the same memory tracker; communication bytes per step
   against the counting run. With CUDA, also world size 1 on the GPU against
   ``torch.cuda.max_memory_allocated``.
2. Scale: ``shardwise plan`` for Llama-3-405B (benchmarks/configs/llama3-405b.json)
   at 16,384 ranks, bf16, seq 8192, batch 16,384, in a fresh process each
   time: wall time and peak resident memory (3 repeats), and the formula's
   per-rank estimates for all 16,384 ranks.

    python benchmarks/bench_plan.py [--json bench_plan.json] [--skip-scale]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

CONFIGS = {
    "gpt fp32, blocks": dict(batch_size=8),
    "gpt bf16, act. ckpt": dict(batch_size=8, precision="bf16", activation_checkpointing=True),
    "gpt shard-grad-op, accum 2": dict(batch_size=8, strategy="shard-grad-op", grad_accum=2),
    "gpt root group, uneven rows": dict(batch_size=8, wrap="root", dim=72, n_heads=3, vocab_size=300),
    "llama (hf) 2 layers": dict(batch_size=8, model="hf", dim=64, n_heads=4, n_layers=2),
}
BIG = ["--model", "hf", "--hf-config", str(ROOT / "benchmarks/configs/llama3-405b.json"), "--nproc", "16384",
       "--precision", "bf16", "--seq-len", "8192", "--batch-size", "16384"]


def _measure(cfg, micro):  # runs on every gloo rank
    import torch.distributed as dist

    from shardwise.train.plan import run_tracked_steps

    return run_tracked_steps(cfg, dist.get_world_size(), micro)


def accuracy() -> list[dict]:
    from shardwise.testing import run_on_ranks
    from shardwise.train.config import TrainConfig
    from shardwise.train.plan import _resolved, plan_training

    rows = []
    for ws in (1, 2, 4):
        for name, settings in CONFIGS.items():
            cfg = TrainConfig(nproc=ws, **settings)
            plan = plan_training(cfg)
            resolved = _resolved(cfg, ws)
            real = run_on_ranks(_measure, ws, cfg=resolved, micro=resolved.micro_batch(ws))
            ratios = [p.peak_bytes / m.peak_bytes for p, m in zip(plan.ranks, real)]
            rows.append({
                "config": name, "world_size": ws, "planned_peak": plan.ranks[0].peak_bytes,
                "measured_peak": real[0].peak_bytes, "worst_ratio": max(ratios, key=lambda r: abs(r - 1)),
                "comm_equal": plan.comm_bytes_per_step == real[plan.heaviest_rank].comm_bytes_per_step,
                "comm_bytes": plan.comm_bytes_per_step,
            })
            print(f"  ws={ws} {name}: planned/measured {rows[-1]['worst_ratio']:.4f}, "
                  f"comm equal {rows[-1]['comm_equal']}", flush=True)
    return rows


def cuda_accuracy(configs: dict | None = None) -> list[dict]:
    """World size 1 on the GPU: planned peak against torch.cuda.max_memory_allocated,
    for ``configs`` (default: all of ``CONFIGS``; tests/gpu runs one)."""
    import torch
    import torch.distributed as dist

    from shardwise.train.config import TrainConfig
    from shardwise.train.model import build_model, shard_model
    from shardwise.train.plan import _resolved, plan_training
    from shardwise.train.step import make_optimizer, training_step

    rows = []
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29571")
    for name, settings in (CONFIGS if configs is None else configs).items():
        cfg = TrainConfig(nproc=1, **{**settings, "batch_size": 8})
        plan = plan_training(cfg)
        resolved = _resolved(cfg, 1)
        dist.init_process_group("nccl", rank=0, world_size=1)
        try:
            device = torch.device("cuda", 0)
            built = build_model(resolved, resolved.vocab_size, torch.device("meta"))
            from torch.distributed.device_mesh import init_device_mesh

            shard_model(built, resolved, init_device_mesh("cuda", (1,)), device, initialise=False)
            optim = make_optimizer(built.model, resolved)
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            for _ in range(2):
                tokens = torch.randint(0, resolved.vocab_size, (8, resolved.seq_len + 1), device=device)
                training_step(built.model, built.logits, optim, lambda: (tokens[:, :-1], tokens[:, 1:]),
                              grad_accum=resolved.grad_accum, grad_clip=resolved.grad_clip, lr=1e-3)
                optim.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
            measured = torch.cuda.max_memory_allocated()
        finally:
            dist.destroy_process_group()
        rows.append({"config": name, "planned_peak": plan.ranks[0].peak_bytes, "cuda_max_allocated": measured,
                     "ratio": plan.ranks[0].peak_bytes / measured})
        print(f"  cuda {name}: planned/max_memory_allocated {rows[-1]['ratio']:.4f}", flush=True)
    return rows


def scale(repeats: int) -> dict:
    times, rss = [], []
    out = Path("/tmp/bench_plan_405b.json")
    code = ("import resource, sys, time; from shardwise.cli import main; t = time.perf_counter(); "
            f"main(sys.argv[1:]); print('WALL', time.perf_counter() - t); "
            "print('MAXRSS', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)")
    for _ in range(repeats):
        start = time.perf_counter()
        proc = subprocess.run([sys.executable, "-c", code, "plan", *BIG, "--json", str(out)], capture_output=True,
                              text=True, env={**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"})
        wall = time.perf_counter() - start
        if proc.returncode:
            raise RuntimeError(proc.stderr[-2000:])
        rss.append(int(next(ln for ln in proc.stdout.splitlines() if ln.startswith("MAXRSS")).split()[1]))
        times.append(wall)
        print(f"  405B @ 16384 ranks: {wall:.1f} s wall (process start to exit), peak RSS {rss[-1] / 2**20:.0f} MiB",
              flush=True)
    plan = json.loads(out.read_text())
    from shardwise.train.config import TrainConfig
    from shardwise.train.launch import Plan, World, estimates

    cfg = TrainConfig(model="hf", hf_config=BIG[3], nproc=16384, precision="bf16", seq_len=8192, batch_size=16384)
    cfg = dataclasses.replace(cfg, vocab_size=128256)
    t = time.perf_counter()
    per_rank, _ = estimates(Plan(cfg, World(16384, False, local_size=16384), "cpu", None, 1, None))  # type: ignore[arg-type]
    formula_s = time.perf_counter() - t
    heaviest = plan["ranks"][plan["heaviest_rank"]]
    return {
        "wall_s": times, "wall_median_s": statistics.median(times), "max_rss_bytes": rss,
        "peak_bytes_rank0": heaviest["peak_bytes"], "by_category_rank0": heaviest["by_category"],
        "comm_bytes_per_step": plan["comm_bytes_per_step"], "simulated_ranks": plan["simulated_ranks"],
        "layers_run": plan["layers_run"], "formula_all_ranks_s": formula_s,
        "formula_model_state_rank0": per_rank[0].model_state,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", default="", help="write the results here")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--skip-scale", action="store_true")
    args = parser.parse_args()
    import torch

    result: dict = {"torch": torch.__version__}
    print("accuracy (planned / measured peak of live tensor bytes, worst rank):", flush=True)
    result["accuracy"] = accuracy()
    if torch.cuda.is_available():
        result["cuda"] = cuda_accuracy()
    if not args.skip_scale:
        print("scale:", flush=True)
        result["scale"] = scale(args.repeats)
        s = result["scale"]
        print(f"  median {s['wall_median_s']:.1f} s, max RSS {max(s['max_rss_bytes']) / 2**30:.2f} GiB; formula for "
              f"16,384 ranks {s['formula_all_ranks_s']:.2f} s")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
