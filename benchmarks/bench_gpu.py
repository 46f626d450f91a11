"""GPU training-step benchmark at world size 1 (NCCL): shardwise vs. PyTorch's
``fully_shard``, with and without CPU offload, and an unsharded local run.

Every config trains the same GPT (``shardwise.models``; default 12 layers,
d=1024, seq 1024, vocab 32768, batch 8) with AdamW on synthetic batches, on one
CUDA device, in one process (one launch):

* ``shardwise``         - ``shardwise.fully_shard`` per block, then the root;
  bf16 parameters, fp32 gradient reduction (``MixedPrecisionPolicy``);
* ``shardwise_nccl``    - the same, with user collectives that call NCCL: at
  world size 1 shardwise's own collectives are skipped (nothing to exchange),
  PyTorch's are issued; this config issues them too (a fair comparison, and
  the trace shows whether the prefetched all-gathers overlap compute);
* ``torch_fsdp``        - ``torch.distributed.fsdp.fully_shard``, the same way;
* ``shardwise_offload`` / ``torch_offload`` - the same with
  ``CPUOffloadPolicy()`` (shards, gradients and the optimizer step on the CPU);
* ``local``             - the model unsharded on the GPU under bf16 autocast
  (fp32 master weights): the no-FSDP yardstick.

``--float8`` converts the FSDP configs' linears (not the head) to torchao's
float8 training with float8 all-gathers (``enable_fsdp_float8_all_gather``).

``--gather-copies`` makes ``shardwise_nccl``'s all-gathers send a copy of
their input: at world size 1 an all-gather in place moves nothing, and with a
copy NCCL moves the bytes on its own stream, so the trace shows where the
prefetched all-gathers run against compute.

``--compile`` compiles every block in place (``block.compile()``, inductor)
after wrapping, as torchtitan does; the warm-up steps absorb compilation.

At world size 1 the collectives copy within the device; what is measured is
each engine's own overhead (copies, hooks, allocation) and, with offload, the
host-device traffic. Per config: the median step time (forward, backward,
optimizer step, ``zero_grad``; CUDA-synchronized) over ``--steps`` steps after
``--warmup``, tokens/s, and the peak ``torch.cuda.max_memory_allocated`` over
those steps (before each config the previous one's garbage is collected and
cuBLAS's workspaces exist already, so each peak is the config's own plus
those). Configs are interleaved over ``--repeats`` repeats; the table
shows each config's median over repeats and its ratio to ``torch_fsdp`` (to
``torch_offload`` for the offload configs).

``--trace DIR`` also records a short profiler trace of shardwise (with and
without offload) and of PyTorch's, and prints an overlap analysis: the share of
each collective's time (NCCL kernels; at world size 1, NCCL's device copies on
its own stream) and of each host-to-device copy's time that a kernel of the
compute stream covered.

Example: ``python benchmarks/bench_gpu.py --json gpu.json --trace /tmp/trace``
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import os
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from _common import run_repeats, write_json

SRC = Path(__file__).resolve().parents[1] / "src"
if importlib.util.find_spec("shardwise") is None:  # not pip-installed: use the source tree
    sys.path.insert(0, str(SRC))

from shardwise.models import GPT, GPTConfig  # noqa: E402

CONFIGS = ("shardwise", "shardwise_nccl", "torch_fsdp", "shardwise_offload", "torch_offload", "local")
MIB = 2**20


def build(config: str, cfg: GPTConfig, args: argparse.Namespace) -> tuple[torch.nn.Module, torch.optim.Optimizer, bool]:
    """The model of ``config`` on the GPU (or its shards on the CPU when
    offloading), its optimizer, and whether it runs under autocast."""
    torch.manual_seed(0)
    offload = config.endswith("_offload")
    model = GPT(cfg)  # built on the CPU (same weights for every config), then placed
    if config == "local":
        model.cuda()
        return model, torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True), True
    if config.startswith("shardwise"):
        from shardwise import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
    else:
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
    kw: dict[str, Any] = {
        "mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
        "offload_policy": CPUOffloadPolicy() if offload else OffloadPolicy(),
    }
    if not offload:
        model.cuda()
    if args.float8:  # torchao's float8 training with float8 all-gathers (fsdp_pre/post_all_gather)
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        convert_to_float8_training(
            model, config=Float8LinearConfig(enable_fsdp_float8_all_gather=True),
            module_filter_fn=lambda mod, fqn: fqn != "lm_head",
        )
    for block in model.blocks:
        fully_shard(block, **kw)
    fully_shard(model, **kw)
    if config == "shardwise_nccl":
        _issue_collectives(model, copies=args.gather_copies)
    # Offloaded shards step on the CPU (as PyTorch documents); else fused CUDA AdamW.
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=not offload)
    return model, opt, False


def _issue_collectives(model: torch.nn.Module, copies: bool = False) -> None:
    """Install user collectives that call NCCL as the defaults do, so that a
    one-rank run issues them (shardwise skips its own there). With ``copies``
    each all-gather sends a copy of its input, not its output's own row: at
    one rank NCCL then moves the bytes (a device copy on its stream) instead
    of nothing, so that a trace shows where the all-gathers run against
    compute, as they would move bytes on two GPUs or more."""
    from shardwise import AllGather, FSDPModule, ReduceScatter
    from shardwise.comm import all_gather_tensor, reduce_scatter_tensor

    class Gather(AllGather):
        def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
            return torch.empty(size, dtype=dtype, device=device)

        def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any,
                     async_op: bool = False) -> Any:
            source = input_tensor.clone() if copies else input_tensor
            return all_gather_tensor(output_tensor, source, group, async_op)

    class Scatter(ReduceScatter):
        def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
            return torch.empty(size, dtype=dtype, device=device)

        def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any, op: Any,
                     async_op: bool = False) -> Any:
            return reduce_scatter_tensor(output_tensor, input_tensor, group, op, async_op)

    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_custom_all_gather(Gather())
            m.set_custom_reduce_scatter(Scatter())


def _allocate_workspaces() -> None:
    """Make cuBLAS's two workspaces (the forward thread's and autograd's)
    before the first config, so that every config's peak holds them alike."""
    a = torch.randn(64, 64, device="cuda", requires_grad=True)
    (a @ a).sum().backward()
    torch.cuda.synchronize()


def run_config(config: str, args: argparse.Namespace) -> dict[str, Any]:
    cfg = GPTConfig(vocab_size=args.vocab, seq_len=args.seq, dim=args.dim, n_layers=args.layers,
                    n_heads=args.heads)
    try:
        gc.collect()  # the previous config's models (reference cycles) must not count in this one's peak
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated()
        model, opt, autocast = build(config, cfg, args)
        if args.compile:
            for block in model.blocks:  # as torchtitan: each block compiled in place (inductor)
                block.compile()
        gen = torch.Generator(device="cuda").manual_seed(0)
        x = torch.randint(0, cfg.vocab_size, (args.batch, cfg.seq_len), device="cuda", generator=gen)
        y = torch.randint(0, cfg.vocab_size, (args.batch, cfg.seq_len), device="cuda", generator=gen)

        def step() -> float:
            with torch.autocast("cuda", torch.bfloat16, enabled=autocast):
                loss = GPT.loss(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            return float(loss.detach())

        for _ in range(args.warmup):
            step()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        times, losses = [], []
        for _ in range(args.steps):
            t0 = time.perf_counter()
            losses.append(step())  # .item() synchronizes
            times.append(time.perf_counter() - t0)
        peak = torch.cuda.max_memory_allocated()
        med = statistics.median(times)
        out = {"step_s": med, "tokens_per_s": args.batch * cfg.seq_len / med,
               "peak_alloc_mib": peak / MIB, "base_alloc_mib": base / MIB,
               "loss_first": losses[0], "loss_last": losses[-1]}
        del model, opt
        gc.collect()
        return out
    except Exception as exc:  # noqa: BLE001 - a failing config is reported, not fatal
        traceback.print_exc()
        return {"error": f"{type(exc).__name__}: {exc}"}


def baseline_of(config: str) -> str:
    return "torch_offload" if config.endswith("_offload") else "torch_fsdp"


def summarize(runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    med: dict[str, dict[str, float]] = {}
    for config, rs in runs.items():
        ok = [r for r in rs if "error" not in r]
        if ok:
            med[config] = {k: statistics.median(r[k] for r in ok) for k in ("step_s", "tokens_per_s", "peak_alloc_mib")}
    summary: dict[str, Any] = {}
    print(f"\n{'config':<18}{'step ms':>9}{'tok/s':>10}{'peak MiB':>10}{'step x':>8}{'mem x':>7}  (vs)")
    for config, m in med.items():
        base = med.get(baseline_of(config))
        rs = (m["step_s"] / base["step_s"]) if base else float("nan")
        rm = (m["peak_alloc_mib"] / base["peak_alloc_mib"]) if base else float("nan")
        summary[config] = {**m, "step_ratio": rs, "mem_ratio": rm, "baseline": baseline_of(config)}
        print(f"{config:<18}{m['step_s'] * 1e3:>9.1f}{m['tokens_per_s']:>10.0f}{m['peak_alloc_mib']:>10.0f}"
              f"{rs:>8.2f}{rm:>7.2f}  ({baseline_of(config)})")
    for config, rs in runs.items():
        for r in rs:
            if "error" in r:
                print(f"{config}: FAILED {r['error']}")
                break
    return summary


# ---- trace and overlap ----------------------------------------------------------


def _intervals(events: list[dict[str, Any]], pred: Any) -> list[tuple[float, float, int, str]]:
    return [(e["ts"], e["ts"] + e.get("dur", 0), e.get("tid", 0), e["name"]) for e in events if pred(e)]


def _overlaps(iv: tuple[float, float, int, str], others: list[tuple[float, float, int, str]]) -> float:
    """Microseconds of ``iv`` covered by some interval of ``others``."""
    a, b = iv[0], iv[1]
    cover = sorted((max(a, s), min(b, e)) for s, e, _, _ in others if s < b and e > a)
    total, end = 0.0, a
    for s, e in cover:
        s = max(s, end)
        if e > s:
            total += e - s
            end = e
    return total


def analyze(trace_file: Path) -> dict[str, Any]:
    """How much of the communication and host copies ran under compute.

    The compute stream is the stream with the most kernel time. A collective
    is an NCCL kernel, or a device-to-device copy on another stream (at world
    size 1 NCCL runs an all-gather as such a copy). For collectives, for
    host-to-device copies and for every other stream: the share of their time
    that a compute-stream kernel covered; and how often, and how long, the
    compute stream sat idle until a collective ended."""
    import json

    events = [e for e in json.loads(trace_file.read_text())["traceEvents"] if e.get("ph") == "X"]
    gpu = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    kernel_time: dict[int, float] = {}
    for e in gpu:
        if e.get("cat") == "kernel":
            kernel_time[e.get("tid", 0)] = kernel_time.get(e.get("tid", 0), 0.0) + e.get("dur", 0)
    if not kernel_time:
        return {"error": "no kernels in the trace"}
    main_stream = max(kernel_time, key=kernel_time.__getitem__)
    every = _intervals(gpu, lambda e: True)
    compute = [k for k in every if k[2] == main_stream and "nccl" not in k[3].lower()]
    side = [k for k in every if k[2] != main_stream]
    collectives = [k for k in every if "nccl" in k[3].lower()
                   or (k[2] != main_stream and "DtoD" in k[3])]
    h2d = [k for k in every if "HtoD" in k[3]]

    def share(items: list[tuple[float, float, int, str]]) -> dict[str, Any]:
        if not items:
            return {"count": 0}
        per = [_overlaps(i, compute) / max(i[1] - i[0], 1e-9) for i in items]
        return {"count": len(items), "total_us": sum(i[1] - i[0] for i in items),
                "overlapped_share_mean": statistics.mean(per),
                "fully_overlapped": sum(p > 0.95 for p in per), "not_overlapped": sum(p < 0.05 for p in per)}

    streams = {str(t): share([k for k in side if k[2] == t]) for t in sorted({k[2] for k in side})}
    busy = sorted((s, e) for s, e, _, _ in every)
    span = (busy[-1][1] - busy[0][0]) if busy else 0.0
    # Compute waiting on communication: an idle gap of the compute stream that
    # ends within 15 us of a collective's end.
    ordered = sorted(compute)
    gaps = [(a[1], b[0]) for a, b in zip(ordered, ordered[1:]) if b[0] - a[1] > 2]
    ends = sorted(c[1] for c in collectives)
    waits = [(s, e) for s, e in gaps if any(s - 1 <= end <= e + 1 and e - end < 15 for end in ends)]
    return {"compute_stream": main_stream, "compute_kernels": len(compute),
            "compute_us": sum(k[1] - k[0] for k in compute), "gpu_span_us": span,
            "compute_idle_us": sum(e - s for s, e in gaps),
            "compute_waited_on_collectives": {"count": len(waits), "us": sum(e - s for s, e in waits)},
            "collectives": share(collectives), "h2d": share(h2d), "other_streams": streams}


def trace(args: argparse.Namespace) -> dict[str, Any]:
    from torch.profiler import ProfilerActivity, profile, schedule

    out: dict[str, Any] = {}
    cfg = GPTConfig(vocab_size=args.vocab, seq_len=args.seq, dim=args.dim, n_layers=args.layers,
                    n_heads=args.heads)
    args.trace.mkdir(parents=True, exist_ok=True)
    for config in args.trace_configs:
        model, opt, _ = build(config, cfg, args)
        x = torch.randint(0, cfg.vocab_size, (args.batch, cfg.seq_len), device="cuda")
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA],
                     schedule=schedule(wait=1, warmup=1, active=1)) as prof:
            for _ in range(3):
                GPT.loss(model(x), x).backward()
                opt.step()
                opt.zero_grad()
                torch.cuda.synchronize()
                prof.step()
        path = args.trace / f"{config}.json"
        prof.export_chrome_trace(str(path))
        out[config] = analyze(path)
        print(f"trace {config}: {out[config]}", flush=True)
        del model, opt
        torch.cuda.empty_cache()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", default=",".join(CONFIGS))
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--dim", type=int, default=1024)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=32768)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--compile", action="store_true", help="compile every block (module.compile(), inductor)")
    p.add_argument("--gather-copies", action="store_true",
                   help="shardwise_nccl's all-gathers send a copy of their input, so that at one rank NCCL moves "
                        "bytes the trace can show against compute")
    p.add_argument("--float8", action="store_true",
                   help="FSDP configs: torchao float8 linears with float8 all-gathers (needs torchao)")
    p.add_argument("--json", type=Path)
    p.add_argument("--trace", type=Path, help="also write profiler traces here and analyze overlap")
    p.add_argument("--trace-configs", default="shardwise,shardwise_nccl,shardwise_offload,torch_fsdp,torch_offload",
                   help="the configs --trace records")
    args = p.parse_args()
    args.configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    args.trace_configs = [c.strip() for c in args.trace_configs.split(",") if c.strip()]
    for c in args.configs + args.trace_configs:
        if c not in CONFIGS:
            p.error(f"--configs: unknown config {c!r}; choose from {', '.join(CONFIGS)}")
    if not torch.cuda.is_available():
        sys.exit("bench_gpu.py needs a CUDA device (see benchmarks/bench_step.py for CPU/gloo)")
    torch.cuda.set_device(0)
    store = dist.FileStore(os.path.join(tempfile.mkdtemp(), "store"), 1)
    dist.init_process_group("nccl", store=store, rank=0, world_size=1)
    _allocate_workspaces()
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}, {args.layers}x{args.dim} "
          f"seq {args.seq} batch {args.batch}", flush=True)
    runs = run_repeats(args, run_config)
    summary = summarize(runs)
    if args.trace:
        summary["trace"] = trace(args)
    if args.json:
        write_json(args.json, args, summary, runs)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
