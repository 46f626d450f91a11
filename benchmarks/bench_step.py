"""Training-step benchmark: shardwise vs. PyTorch FSDP2 vs. DDP vs. an unsharded local run.

All configs train the same GPT (``shardwise.models``) with AdamW on synthetic batches, on
CPU with the gloo backend, ``--nproc`` ranks (default 2), one thread per rank:

* ``shardwise``  - ``shardwise.fully_shard`` on every block, then on the root;
* ``torch_fsdp`` - ``torch.distributed.fsdp.fully_shard``, wrapped the same way;
* ``ddp``        - ``DistributedDataParallel`` (full replica per rank, gradient all-reduce);
* ``local``      - each rank trains its own full copy, no communication at all;
* ``torch_fsdp1`` - PyTorch's ``FullyShardedDataParallel`` (FSDP1: flat parameters),
  ``FULL_SHARD`` with one unit per block (``ModuleWrapPolicy``) and the root,
  ``use_orig_params=True``, ``device_id=cpu``;
* ``shardwise_int8`` - shardwise with ``QuantizedAllGather`` (int8 + per-block scales)
  as every module's all-gather (``set_custom_all_gather``);
* ``shardwise_fsdp1`` (on request) - shardwise's ``FullyShardedDataParallel``, as ``torch_fsdp1``;
* ``shardwise_gloo_collectives`` (on request) - ``shardwise`` calling gloo's all-gather and
  reduce-scatter as PyTorch does, not its in-place path ([Note: gloo without its copies]);
* ``shardwise_shm`` (on request) - ``shardwise`` with ``SHARDWISE_SHARED_MEMORY=1``: at two
  ranks the large rows through shared memory, only descriptors over gloo ([Note: shared rows]);
* ``shardwise_compiled`` / ``torch_compiled`` (on request only) - ``shardwise`` /
  ``torch_fsdp`` with every block then compiled in place (``block.compile()``,
  inductor), as torchtitan does; the warm-up steps absorb compilation.

``RSS growth`` is the peak resident set size minus the resident size just before the
model was built (the Python / torch / process-group baseline left out): the memory the
model, its training and the library's buffers cost. The ``AG MiB/step`` column is the bytes each rank receives from parameter
all-gathers per step (counted at each library's all-gather call), for the FSDP configs.
``faults/step`` is the minor page faults a rank takes per timed step (``ru_minflt``): almost
all of them pages the allocator takes fresh from the system, each zeroed by the kernel, so it
counts allocator churn (freed memory returned to the system and asked for again).

Each config runs in its own freshly spawned set of rank processes, one config after another,
so a process's peak RSS belongs to that config alone.  Per rank we measure the median step
time (zero_grad + forward + backward + AdamW step, ``foreach`` per ``--foreach``) over ``--steps`` steps after ``--warmup``
steps, the peak resident set size (``ru_maxrss``) and the model-state bytes this rank holds:
parameters + gradients + optimizer state (for DTensors only the local shard counts).
The table shows, per config, the worst rank's value, as the median over ``--repeats`` runs
of the whole set of configs.  Peak RSS includes the Python/torch baseline (a few hundred MiB)
and the full model every rank builds before wrapping.

Ratios are taken against ``torch_fsdp``: a step ratio of 1.10 means 10% slower than PyTorch's
fully_shard; RSS / state ratios below 1 mean less memory.  With ``--nproc 2`` both FSDP
implementations should hold about half of DDP's / local's model state.  ``--mp bf16``
(bf16 params, fp32 gradient reduction) applies to the two FSDP configs only; DDP and local
stay in fp32.  Timings are only comparable on an otherwise idle machine.

Example: ``python benchmarks/bench_step.py --configs torch_fsdp,ddp --steps 10 --json out.json``
"""

from __future__ import annotations

import os

os.environ["OMP_NUM_THREADS"] = "1"  # before torch is imported, here and in every rank

import argparse
import datetime
import importlib.util
import resource
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from _common import run_repeats, spawn_ranks, write_json, write_rank_result

SRC = Path(__file__).resolve().parents[1] / "src"
if importlib.util.find_spec("shardwise") is None:  # not pip-installed: use the source tree
    sys.path.insert(0, str(SRC))
try:
    from shardwise.models import GPT, GPTConfig, synthetic_batch
except Exception:  # noqa: BLE001 - the package itself is broken: load the model file alone
    _spec = importlib.util.spec_from_file_location("_bench_models", SRC / "shardwise" / "models.py")
    assert _spec is not None and _spec.loader is not None
    _models = sys.modules["_bench_models"] = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(_models)
    GPT, GPTConfig, synthetic_batch = _models.GPT, _models.GPTConfig, _models.synthetic_batch

CONFIGS = ("shardwise", "torch_fsdp", "torch_fsdp1", "ddp", "local", "shardwise_int8")
# Not in the default set (compiling takes a minute per config): ask for them by name.
EXTRA_CONFIGS = ("shardwise_compiled", "torch_compiled", "shardwise_fsdp1", "shardwise_gloo_collectives", "shardwise_shm")
BASELINE = "torch_fsdp"
# ``--foreach``: AdamW's implementation, the same for every config. "on" is what AdamW picks
# by itself on CUDA for DTensor and plain parameters alike; on CPU its default ("default"
# here) is the per-parameter loop, which for DTensors pays DTensor's dispatch ~10 times per
# parameter per step ([Note: the benchmark's optimizer] in docs/decisions.md).
FOREACH = {"on": True, "off": False, "default": None}
MIB = 2**20


def local_bytes(t: torch.Tensor) -> int:
    """Bytes of ``t`` held by this rank (a DTensor's local shard only)."""
    if hasattr(t, "to_local"):
        t = t.to_local()
    return t.numel() * t.element_size()


def model_state_bytes(model: torch.nn.Module, opt: torch.optim.Optimizer) -> int:
    """Parameters + gradients + optimizer state held locally by this rank."""
    total = 0
    for p in model.parameters():
        total += local_bytes(p)
        if p.grad is not None:
            total += local_bytes(p.grad)
    for state in opt.state.values():
        total += sum(local_bytes(v) for v in state.values() if isinstance(v, torch.Tensor))
    return total


def shardwise_api() -> tuple[Any, Any]:
    """Return shardwise's ``(fully_shard, MixedPrecisionPolicy)``; raises ImportError if absent."""
    from shardwise import fully_shard

    try:
        from shardwise import MixedPrecisionPolicy
    except ImportError:
        from torch.distributed.fsdp import MixedPrecisionPolicy
    return fully_shard, MixedPrecisionPolicy


def wrap(config: str, model: GPT, args: argparse.Namespace, world_size: int) -> torch.nn.Module:
    """Apply ``config``'s parallelism to ``model`` (all ranks must build identical models)."""
    if config == "local":
        return model
    if config == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(model)
    if config.endswith("_fsdp1"):
        return wrap_fsdp1(config, model, args)
    if config.startswith("shardwise"):
        fully_shard, mp_cls = shardwise_api()
    else:
        from torch.distributed.fsdp import MixedPrecisionPolicy as mp_cls
        from torch.distributed.fsdp import fully_shard
    from torch.distributed.device_mesh import init_device_mesh

    kwargs: dict[str, Any] = {"mesh": init_device_mesh("cpu", (world_size,))}
    if args.mp == "bf16":
        kwargs["mp_policy"] = mp_cls(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.blocks:
        fully_shard(block, **kwargs)
    model = fully_shard(model, **kwargs)
    if config.endswith("_compiled"):
        for block in model.blocks:
            block.compile()
    if config == "shardwise_shm":  # two ranks of one host through shared memory ([Note: shared rows])
        os.environ["SHARDWISE_SHARED_MEMORY"] = "1"
    if config == "shardwise_gloo_collectives":  # gloo's own collectives, as PyTorch calls them
        import shardwise.comm

        shardwise.comm._in_place_gloo = lambda *_args: False
    if config == "shardwise_int8":
        from shardwise import FSDPModule, QuantizedAllGather

        for m in model.modules():
            if isinstance(m, FSDPModule):
                m.set_custom_all_gather(QuantizedAllGather())
    return model


def wrap_fsdp1(config: str, model: GPT, args: argparse.Namespace) -> torch.nn.Module:
    """The wrapper API (PyTorch's FSDP1, or shardwise's of the same name):
    ``FULL_SHARD``, one unit per block plus the root, as the per-module configs."""
    if config.startswith("shardwise"):
        from shardwise import FullyShardedDataParallel as FSDP
        from shardwise import MixedPrecision
        from shardwise.wrap import ModuleWrapPolicy
    else:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp import MixedPrecision
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy
    block_cls = type(model.blocks[0])
    mixed = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if args.mp == "bf16" else None
    return FSDP(model, auto_wrap_policy=ModuleWrapPolicy({block_cls}), mixed_precision=mixed,
                device_id=torch.device("cpu"), use_orig_params=True)


_AG_BYTES = [0]


def _current_rss_mib() -> float:
    """This process's resident set size now (Linux ``/proc``; 0 elsewhere)."""
    try:
        resident_pages = int(Path("/proc/self/statm").read_text().split()[1])
    except (OSError, IndexError, ValueError):
        return 0.0
    return resident_pages * os.sysconf("SC_PAGE_SIZE") / MIB


def count_all_gather_bytes(config: str) -> None:
    """Count the bytes every parameter all-gather receives. PyTorch's FSDPs
    call ``dist.all_gather_single``; shardwise's collectives (its defaults and
    ``QuantizedAllGather``) go through ``shardwise.comm.all_gather_tensor``,
    which is wrapped instead: replacing ``dist.all_gather_single`` would make
    shardwise call the replacement, as PyTorch's test utilities expect, and
    so leave its in-place gloo path ([Note: gloo without its copies])."""

    def counted(orig: Any) -> Any:
        def counting(output_tensor: torch.Tensor, input_tensor: torch.Tensor, *a: Any, **k: Any) -> Any:
            _AG_BYTES[0] += output_tensor.numel() * output_tensor.element_size()
            return orig(output_tensor, input_tensor, *a, **k)

        return counting

    if config.startswith("shardwise"):
        import shardwise.comm

        shardwise.comm.all_gather_tensor = counted(shardwise.comm.all_gather_tensor)
    else:
        dist.all_gather_single = counted(dist.all_gather_single)


def worker(rank: int, config: str, args: argparse.Namespace, port: int, out_dir: str) -> None:
    """One rank of one config: train, time, measure, write ``rank{rank}.json`` to ``out_dir``."""
    torch.set_num_threads(1)
    write_rank_result(Path(out_dir) / f"rank{rank}.json", lambda: _measure(rank, config, args, port))


def _measure(rank: int, config: str, args: argparse.Namespace, port: int) -> dict[str, Any]:
    if config != "local":
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=args.nproc,
            timeout=datetime.timedelta(seconds=args.timeout),
        )
    cfg = GPTConfig(
        vocab_size=args.vocab, seq_len=args.seq_len, dim=args.dim,
        n_layers=args.layers, n_heads=args.heads,
    )
    base_rss_mib = _current_rss_mib()
    torch.manual_seed(0)
    model = GPT(cfg)
    n_params = model.num_params()
    if hasattr(dist, "all_gather_single"):
        count_all_gather_bytes(config)
    model = wrap(config, model, args, args.nproc)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=FOREACH[args.foreach])
    batches = [
        synthetic_batch(cfg, args.batch_size, seed=i, rank=rank)
        for i in range(args.warmup + args.steps)
    ]
    times, losses = [], []
    faults0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for i, (inputs, targets) in enumerate(batches):
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = GPT.loss(model(inputs), targets)
        loss.backward()
        opt.step()
        elapsed = time.perf_counter() - t0
        losses.append(loss.item())
        if i == args.warmup - 1:
            _AG_BYTES[0] = 0
            faults0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        if i >= args.warmup:
            times.append(elapsed)
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults0
    result = {
        "step_ms": 1e3 * statistics.median(times),
        "peak_rss_mib": (peak := resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
        "rss_growth_mib": peak - base_rss_mib,
        "state_mib": model_state_bytes(model, opt) / MIB,
        "ag_mib_per_step": _AG_BYTES[0] / MIB / args.steps,
        "faults_per_step": faults / args.steps,  # allocator churn (see the module docstring)
        "num_params": n_params,
        "first_loss": losses[0],
        "last_loss": losses[-1],
    }
    return result


def run_config(config: str, args: argparse.Namespace) -> dict[str, Any]:
    """Spawn fresh ranks for one config; return per-rank results or an ``error`` message."""
    if config.startswith("shardwise"):
        try:
            shardwise_api()
        except Exception as exc:  # noqa: BLE001 - any import failure means "not there yet"
            return {"error": f"unavailable: {type(exc).__name__}: {exc}"}
    return spawn_ranks(worker, config, args)


def summarise(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Worst rank per run, then the median over runs (repeats) for each metric."""
    good = [r for r in runs if "ranks" in r]
    if not good:
        return {"error": runs[0]["error"] if runs else "not run"}
    out: dict[str, Any] = {}
    for key in ("step_ms", "peak_rss_mib", "rss_growth_mib", "state_mib", "ag_mib_per_step", "faults_per_step"):
        out[key] = statistics.median(max(rk.get(key, 0.0) for rk in r["ranks"]) for r in good)
    out["repeats_ok"] = len(good)
    return out


def format_table(summary: dict[str, dict[str, Any]]) -> str:
    """Plain-text table with ratios to the ``torch_fsdp`` baseline."""
    head = ("config", "step ms", "peak RSS MiB", "RSS growth", "state MiB", "AG MiB/step",
            "step/torch", "growth/torch", "state/torch", "AG/torch", "faults/step")
    lines = ["{:<16} {:>9} {:>13} {:>11} {:>10} {:>12} {:>11} {:>13} {:>12} {:>9} {:>12}".format(*head)]
    base = summary.get(BASELINE, {})
    for config, s in summary.items():
        if "error" in s:
            lines.append(f"{config:<15} {s['error'][:110]}")
            continue
        ratios = []
        for key in ("step_ms", "rss_growth_mib", "state_mib", "ag_mib_per_step"):
            ok = key in base and base[key] > 0 and s[key] > 0
            ratios.append(f"{s[key] / base[key]:.2f}" if ok else "-")
        lines.append(
            f"{config:<16} {s['step_ms']:>9.1f} {s['peak_rss_mib']:>13.1f} {s['rss_growth_mib']:>11.1f}"
            f" {s['state_mib']:>10.2f} {s['ag_mib_per_step']:>12.2f} {ratios[0]:>11} {ratios[1]:>13}"
            f" {ratios[2]:>12} {ratios[3]:>9} {s.get('faults_per_step', 0.0):>12.0f}"
        )
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--configs", default=",".join(CONFIGS),
                   help="comma-separated subset of %(default)s")
    p.add_argument("--nproc", type=int, default=2, help="world size (ranks per config)")
    p.add_argument("--steps", type=int, default=20, help="timed steps")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps first")
    p.add_argument("--repeats", type=int, default=3, help="runs of the whole set; median reported")
    p.add_argument("--mp", choices=("none", "bf16"), default="none",
                   help="bf16: param_dtype=bf16, reduce_dtype=fp32 for both FSDP implementations")
    p.add_argument("--foreach", choices=tuple(FOREACH), default="on",
                   help="AdamW's foreach= for every config: on (CUDA's default), off, or "
                        "default (torch's choice: off on CPU)")
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=4, help="per rank")
    p.add_argument("--timeout", type=float, default=600, help="collective timeout, seconds")
    p.add_argument("--json", type=Path, help="also write all results to this file")
    args = p.parse_args(argv)
    args.configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = sorted(set(args.configs) - set(CONFIGS) - set(EXTRA_CONFIGS))
    if unknown or not args.configs:
        p.error(f"--configs: unknown {unknown}; choose from {','.join(CONFIGS + EXTRA_CONFIGS)}")
    if args.nproc < 1 or args.steps < 1 or args.warmup < 0 or args.repeats < 1:
        p.error("--nproc, --steps and --repeats must be >= 1, --warmup >= 0")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cfg = GPTConfig(vocab_size=args.vocab, seq_len=args.seq_len, dim=args.dim,
                    n_layers=args.layers, n_heads=args.heads)  # validates the sizes early
    print(
        f"GPT dim={cfg.dim} layers={cfg.n_layers} heads={cfg.n_heads} seq={cfg.seq_len} "
        f"vocab={cfg.vocab_size}; batch {args.batch_size}/rank; {args.nproc} ranks (gloo, CPU, "
        f"1 thread each); mp={args.mp}; AdamW foreach={args.foreach}; {args.warmup} warmup + {args.steps} timed steps; "
        f"{args.repeats} repeat(s); torch {torch.__version__}",
        flush=True,
    )
    runs = run_repeats(args, run_config)
    summary = {c: summarise(r) for c, r in runs.items()}
    print(format_table(summary))
    if args.json:
        write_json(args.json, args, summary, runs)
    failed = [c for c, s in summary.items() if s.get("error", "").startswith("failed")]
    return 1 if failed else 0  # an "unavailable" config is reported, not a failure


if __name__ == "__main__":
    sys.exit(main())
