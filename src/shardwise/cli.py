"""``shardwise`` command line: ``shardwise train`` trains the built-in GPT-style
model with ``fully_shard`` on several local ranks (or as one rank of a
``torchrun`` launch) and reports each rank's model-state memory next to what
an unsharded copy would hold."""

from __future__ import annotations

import argparse
import os
import socket
import sys
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path

import torch

__all__ = ["main"]


@dataclass(frozen=True)
class TrainArgs:
    nproc: int
    steps: int
    batch_size: int
    seq_len: int
    dim: int
    n_layers: int
    n_heads: int
    lr: float
    seed: int
    precision: str
    log_every: int


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="shardwise", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="train the built-in GPT-style model with fully_shard")
    train.add_argument("--nproc", type=int, default=2, help="local ranks to launch (ignored under torchrun)")
    train.add_argument("--steps", type=int, default=200)
    train.add_argument("--batch-size", type=int, default=8, help="sequences per rank per step")
    train.add_argument("--seq-len", type=int, default=64)
    train.add_argument("--dim", type=int, default=128)
    train.add_argument("--n-layers", type=int, default=4)
    train.add_argument("--n-heads", type=int, default=4)
    train.add_argument("--lr", type=float, default=3e-3)
    train.add_argument("--seed", type=int, default=0)
    train.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
    train.add_argument("--log-every", type=int, default=20)
    return parser


def stdlib_corpus(max_bytes: int = 4 << 20) -> bytes:
    """Byte-level text that ships with Python itself: the standard library's
    sources, in a fixed order, so training needs no download."""
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks: list[bytes] = []
    total = 0
    for path in sorted(root.glob("*.py")):
        data = path.read_bytes()
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    if not chunks:
        raise FileNotFoundError(f"no Python sources found under {root} to train on")
    return b"".join(chunks)[:max_bytes]


def _batch(data: torch.Tensor, args: TrainArgs, step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s batch for ``step``: random windows, deterministic in (seed, step, rank)."""
    gen = torch.Generator().manual_seed(args.seed * 1_000_003 + step * 1009 + rank)
    starts = torch.randint(0, data.numel() - args.seq_len - 1, (args.batch_size,), generator=gen)
    idx = starts[:, None] + torch.arange(args.seq_len + 1)
    window = data[idx].long()
    return window[:, :-1], window[:, 1:]


def _state_bytes(model: torch.nn.Module, optim: torch.optim.Optimizer) -> tuple[int, int]:
    """(bytes this rank holds, bytes an unsharded copy would hold) for parameters,
    gradients and optimizer state."""
    from torch.distributed.tensor import DTensor

    def local(t: torch.Tensor) -> torch.Tensor:
        return t.to_local() if isinstance(t, DTensor) else t

    held = full = 0
    for p in model.parameters():
        tensors = [p] + ([p.grad] if p.grad is not None else [])
        tensors += [v for v in optim.state.get(p, {}).values() if isinstance(v, torch.Tensor) and v.ndim > 0]
        for t in tensors:
            held += local(t).numel() * t.element_size()
            full += t.numel() * t.element_size()
    return held, full


def _train_rank(rank: int, world_size: int, args: TrainArgs, port: int | None) -> None:
    import torch.distributed as dist

    from shardwise import MixedPrecisionPolicy, fully_shard
    from shardwise.models import GPT, GPTConfig

    torch.set_num_threads(1)
    if port is not None:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    else:
        dist.init_process_group()
    try:
        cfg = GPTConfig(vocab_size=256, seq_len=args.seq_len, dim=args.dim, n_layers=args.n_layers, n_heads=args.n_heads)
        torch.manual_seed(args.seed)
        model = GPT(cfg)
        mp = MixedPrecisionPolicy()
        if args.precision == "bf16":
            mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for block in model.blocks:
            fully_shard(block, mp_policy=mp)
        fully_shard(model, mp_policy=mp)
        optim = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
        data = torch.frombuffer(bytearray(stdlib_corpus()), dtype=torch.uint8)
        if rank == 0:
            print(f"shardwise train: {world_size} ranks, GPT {cfg.n_layers}x{cfg.dim}, "
                  f"{model.num_params() / 1e6:.2f}M params, {len(data) / 1e6:.1f} MB of stdlib text", flush=True)
        tokens_per_step = args.batch_size * args.seq_len * world_size
        t0 = time.perf_counter()
        first = last = float("nan")
        for step in range(1, args.steps + 1):
            x, y = _batch(data, args, step, rank)
            loss = GPT.loss(model(x), y)
            loss.backward()
            optim.step()
            optim.zero_grad()
            value = loss.detach().float()
            dist.all_reduce(value, op=dist.ReduceOp.AVG)
            last = value.item()
            first = last if step == 1 else first
            if rank == 0 and (step % args.log_every == 0 or step == 1 or step == args.steps):
                rate = tokens_per_step * step / (time.perf_counter() - t0)
                print(f"step {step:5d} | loss {last:.4f} | {rate:,.0f} tok/s", flush=True)
        held, full = _state_bytes(model, optim)
        # gradients were freed by zero_grad: count them as a parameter-sized buffer
        numbers = [None] * world_size
        dist.all_gather_object(numbers, (held, full))
        if rank == 0:
            print(f"loss {first:.4f} -> {last:.4f} over {args.steps} steps")
            print("model state (params + optimizer state) per rank:")
            for r, (h, f) in enumerate(numbers):  # type: ignore[misc]
                print(f"  rank {r}: {h / 2**20:8.2f} MiB held, unsharded copy {f / 2**20:8.2f} MiB "
                      f"({h / f:.0%})")
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def train(args: TrainArgs) -> None:
    """Run under torchrun (one rank, env:// rendezvous) or spawn ``nproc`` local ranks."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        _train_rank(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), args, None)
        return
    if args.nproc < 1:
        raise SystemExit(f"--nproc must be >= 1, got {args.nproc}")
    import torch.multiprocessing as mp

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.start_processes(_train_rank, args=(args.nproc, args, _free_port()), nprocs=args.nproc, start_method="spawn")


def main(argv: list[str] | None = None) -> None:
    ns = _parser().parse_args(argv)
    if ns.command == "train":
        train(TrainArgs(ns.nproc, ns.steps, ns.batch_size, ns.seq_len, ns.dim, ns.n_layers, ns.n_heads,
                        ns.lr, ns.seed, ns.precision, ns.log_every))


if __name__ == "__main__":
    main(sys.argv[1:])
