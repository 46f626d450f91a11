"""Peak host memory of loading a sharded Hugging Face directory (``shardwise train
--model hf --init-from DIR``'s path) on ``--nproc`` gloo ranks: a memory
measurement, not a timing one.

The parent process builds a Llama (``transformers.LlamaForCausalLM``, fp32, default
sizes about 1.96 GB: hidden 2048, 7 layers, MLP 5632, vocabulary 32000, untied
embeddings) and writes it with ``save_pretrained(DIR, max_shard_size=...)`` into
several safetensors shards and an index. Then, per config, fresh ranks each do
what ``shardwise train`` does with ``--init-from DIR``:

1. build the model from ``DIR/config.json`` on the meta device
   (``shardwise.train.model.build_model``),
2. ``fully_shard`` each decoder layer and the root, materialise only the
   rank's shards (``to_empty``) and recompute the non-persistent buffers
   (``shard_model``),
3. ``checkpoint.load_from_file(DIR, model)``: each rank reads only its chunk of
   each tensor.

Per rank we report the growth of peak RSS over these three steps (and one
pass over the loaded values, a checksum): ``VmHWM``
after them minus ``VmRSS`` before, where ``VmHWM`` was reset just before
(each rank first runs the same steps on a tiny model of the same
architecture, so that lazy imports and one-time set-up are not counted)
(``/proc/self/clear_refs``, "5"; if the kernel refuses, a thread samples
``/proc/self/statm`` every millisecond instead). Next to it: the rank's shard
bytes (its local parameters and buffers), shard bytes + the largest tensor of
the model (the bound the design aims for: shards plus one tensor in flight),
and the full model's bytes (what ``from_pretrained`` on every rank holds).
The same pages are also in the page cache (the files were just written);
page cache is not RSS.

Configs:

* ``shardwise``: the library as it is (its own safetensors reader: seek +
  ``readinto`` into a fresh tensor per rank's chunk).
* ``safe_open``: the same, but every chunk read with the official reader,
  ``safetensors.safe_open(file).get_slice(name)[rows]`` (files memory-mapped,
  kept open for the whole load as shardwise keeps its file handles), to show
  what the choice of reader costs.
* ``from_pretrained``: ``AutoModelForCausalLM.from_pretrained(DIR)`` on every
  rank (no sharding), for reference.

Example: ``python benchmarks/bench_hf_load.py --nproc 4``
(``--layers 2 --hidden 512 --vocab 4096`` for a quick run).
"""

from __future__ import annotations

import os

os.environ["OMP_NUM_THREADS"] = "1"  # before torch is imported, here and in every rank

import argparse
import contextlib
import ctypes
import datetime
import gc
import importlib.util
import json
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from _common import spawn_ranks, write_json, write_rank_result

SRC = Path(__file__).resolve().parents[1] / "src"
if importlib.util.find_spec("shardwise") is None:  # not pip-installed: use the source tree
    sys.path.insert(0, str(SRC))

CONFIGS = ("shardwise", "safe_open", "from_pretrained")
MB = 1e6
_PAGE = os.sysconf("SC_PAGE_SIZE")


def _status_kib(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise KeyError(key)


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * _PAGE


class PeakRSS:
    """Peak RSS over a block: ``VmHWM`` reset on entry (``clear_refs``), or
    sampled every millisecond where the kernel does not allow the reset."""

    def __enter__(self) -> PeakRSS:
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL("libc.so.6").malloc_trim(0)  # freed heap back to the OS first
        gc.collect()
        self.start = _rss_bytes()
        self.method = "VmHWM"
        self.hwm_before = _status_kib("VmHWM") * 1024  # the reset forgets it: an enclosing PeakRSS needs it
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
        except OSError:
            self.method = "sampled"
        self.peak = self.start
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if self.method == "sampled":
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, _rss_bytes())
            time.sleep(0.001)

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.peak = max(self.peak, _rss_bytes())
        if self.method == "VmHWM":
            self.peak = max(self.peak, _status_kib("VmHWM") * 1024)

    @property
    def growth(self) -> int:
        return self.peak - self.start


def llama_config(args: argparse.Namespace) -> Any:
    import transformers

    return transformers.LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
        num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.heads,
        max_position_embeddings=2048, tie_word_embeddings=False,
    )


def save_model(args: argparse.Namespace, path: Path) -> dict[str, Any]:
    """Build the Llama (seeded) and save_pretrained it into shards; return its sizes."""
    import transformers

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(llama_config(args))
    sizes = {
        "model_bytes": sum(t.numel() * t.element_size() for t in model.state_dict().values()),
        "largest_tensor_bytes": max(t.numel() * t.element_size() for t in model.state_dict().values()),
        "num_params": sum(p.numel() for p in model.parameters()),
    }
    model.save_pretrained(path, max_shard_size=args.max_shard_size)
    del model
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    sizes["files"] = sorted(p.name for p in path.glob("*.safetensors"))
    return sizes


@contextlib.contextmanager
def safe_open_reader() -> Any:
    """Make load_from_file read each chunk with safetensors' safe_open
    (handles opened once per file and kept open for the whole load)."""
    from safetensors import safe_open
    from torch.distributed.tensor import DTensor

    import shardwise.checkpoint.single_file as single_file

    handles: dict[str, Any] = {}
    real = single_file._read_local

    def read(source: Any, value: torch.Tensor) -> torch.Tensor:
        _f, _header, file, name = source
        if file not in handles:
            handles[file] = safe_open(file, "pt").__enter__()
        sl = handles[file].get_slice(name)
        if isinstance(value, DTensor):
            offset, size = single_file.local_box(value)
            return sl[tuple(slice(o, o + s) for o, s in zip(offset, size))]  # type: ignore[no-any-return]
        return handles[file].get_tensor(name)  # type: ignore[no-any-return]

    single_file._read_local = read  # type: ignore[assignment]
    try:
        yield
    finally:
        single_file._read_local = real
        for h in handles.values():
            h.__exit__(None, None, None)


def load_sharded(path: Path, world_size: int, marks: dict[str, int] | None = None) -> torch.nn.Module:
    """What ``shardwise train --model hf --init-from DIR`` does before training;
    ``marks`` gets the RSS after the model is sharded and materialised, and
    the peak RSS during ``load_from_file`` alone."""
    from torch.distributed.device_mesh import init_device_mesh

    from shardwise.checkpoint import load_from_file
    from shardwise.train.config import TrainConfig
    from shardwise.train.model import build_model, hf_vocab_size, shard_model

    cfg = TrainConfig(model="hf", init_from=str(path), nproc=world_size)
    built = build_model(cfg, hf_vocab_size(cfg) or 0, torch.device("cpu"))
    shard_model(built, cfg, init_device_mesh("cpu", (world_size,)), torch.device("cpu"))
    if marks is None:
        load_from_file(path, built.model)
    else:
        marks["sharded_rss"] = _rss_bytes()
        with PeakRSS() as peak:
            load_from_file(path, built.model)
        marks["load_peak"] = peak.peak
        marks["before_load_peak"] = peak.hwm_before
    return built.model


def worker(rank: int, config: str, args: argparse.Namespace, port: int, out_dir: str) -> None:
    def measure() -> dict[str, Any]:
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=args.nproc,
                                timeout=datetime.timedelta(seconds=args.timeout))
        import transformers  # noqa: F401 - imported before the baseline: not part of the load
        from torch.distributed.tensor import DTensor

        import shardwise.train.model  # noqa: F401

        path = Path(args.model_dir)
        # Warm up on a tiny model of the same architecture: lazy imports (the
        # modeling module), DTensor dispatch caches, gloo buffers are not the load's.
        warm = Path(args.warmup_dir)
        if config == "from_pretrained":
            transformers.AutoModelForCausalLM.from_pretrained(warm)
        else:
            with safe_open_reader() if config == "safe_open" else contextlib.nullcontext():
                load_sharded(warm, args.nproc)
        dist.barrier()
        marks: dict[str, int] = {}
        with PeakRSS() as peak:
            t0 = time.perf_counter()
            if config == "from_pretrained":
                model = transformers.AutoModelForCausalLM.from_pretrained(path)
            elif config == "safe_open":
                with safe_open_reader():
                    model = load_sharded(path, args.nproc, marks)
            else:
                model = load_sharded(path, args.nproc, marks)
            elapsed = time.perf_counter() - t0
            # A checksum of this rank's values (do the configs agree?), inside the
            # measurement: it touches every value once (from_pretrained may leave
            # them in memory-mapped files until then).
            total = sum(float((t.to_local() if isinstance(t, DTensor) else t).detach().sum(dtype=torch.float64))
                        for t in model.parameters())
        held = 0
        for t in list(model.parameters()) + list(model.buffers()):
            local = t.to_local() if isinstance(t, DTensor) else t
            held += local.numel() * local.element_size()
        dist.barrier()
        phases = {f"{k}_growth": v - peak.start for k, v in marks.items()}
        growth = max(peak.growth, marks.get("before_load_peak", 0) - peak.start)  # the inner reset hid it
        return {"peak_growth": growth, "method": peak.method, "held_bytes": held, "load_s": elapsed,
                "checksum": total, **phases}

    write_rank_result(Path(out_dir) / f"rank{rank}.json", measure)


def format_table(args: argparse.Namespace, sizes: dict[str, Any], results: dict[str, Any]) -> str:
    full, largest = sizes["model_bytes"], sizes["largest_tensor_bytes"]
    lines = [
        f"model: {sizes['num_params'] / 1e6:.1f} M parameters, {full / MB:.0f} MB fp32 in "
        f"{len(sizes['files'])} files (max_shard_size {args.max_shard_size}); largest tensor {largest / MB:.0f} MB; "
        f"{args.nproc} ranks",
        "{:<16} {:>4} {:>9} {:>10} {:>11} {:>9} {:>13} {:>12} {:>12} {:>7}".format(
            "config", "rank", "peak+ MB", "sharded MB", "in load MB", "shard MB", "shard+max MB", "/(shard+max)",
            "/full model", "load s"),
    ]
    for config, res in results.items():
        if "error" in res:
            lines.append(f"{config:<16} {res['error'][:110]}")
            continue
        for r, rk in enumerate(res["ranks"]):
            grow, held = rk["peak_growth"], rk["held_bytes"]
            sharded = f"{rk['sharded_rss_growth'] / MB:.0f}" if "sharded_rss_growth" in rk else "-"
            in_load = f"{rk['load_peak_growth'] / MB:.0f}" if "load_peak_growth" in rk else "-"
            lines.append("{:<16} {:>4} {:>9.0f} {:>10} {:>11} {:>9.0f} {:>13.0f} {:>12.2f} {:>12.2f} {:>7.1f}".format(
                config, r, grow / MB, sharded, in_load, held / MB, (held + largest) / MB, grow / (held + largest),
                grow / full, rk["load_s"]))
    method = {rk["method"] for res in results.values() if "ranks" in res for rk in res["ranks"]}
    lines.append(f"(peak+ = peak RSS growth over build + shard + load, by {', '.join(sorted(method))}; sharded = "
                 "RSS growth once the model is sharded and materialised (to_empty: untouched pages); in load = peak "
                 "growth during load_from_file; shard = the rank's local parameters and buffers; load s is "
                 "informational: shared cores)")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", default="shardwise,safe_open", help=f"comma-separated subset of {','.join(CONFIGS)}")
    p.add_argument("--nproc", type=int, default=4, help="world size")
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--intermediate", type=int, default=5632)
    p.add_argument("--layers", type=int, default=7)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--max-shard-size", default="500MB", help="save_pretrained's max_shard_size")
    p.add_argument("--dir", default=None, help="where the model is written (default: system temp dir)")
    p.add_argument("--timeout", type=float, default=900, help="collective timeout, seconds")
    p.add_argument("--json", type=Path, help="also write all results to this file")
    args = p.parse_args(argv)
    args.configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = sorted(set(args.configs) - set(CONFIGS))
    if unknown or not args.configs:
        p.error(f"--configs: unknown {unknown}; choose from {','.join(CONFIGS)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="bench_hf_load_", dir=args.dir))
    try:
        args.model_dir = str(tmp / "llama")
        args.warmup_dir = str(tmp / "warmup")
        tiny = argparse.Namespace(**{**vars(args), "hidden": 64, "intermediate": 128, "layers": 2, "heads": 4,
                                     "vocab": 256, "max_shard_size": "50KB"})
        save_model(tiny, Path(args.warmup_dir))
        t0 = time.perf_counter()
        sizes = save_model(args, Path(args.model_dir))
        print(f"saved {sizes['num_params'] / 1e6:.1f} M parameters into {len(sizes['files'])} files "
              f"({time.perf_counter() - t0:.0f} s)", flush=True)
        results: dict[str, Any] = {}
        for config in args.configs:
            t0 = time.perf_counter()
            results[config] = spawn_ranks(worker, config, args)
            print(f"  {config}: {results[config].get('error', 'ok')} ({time.perf_counter() - t0:.0f} s)", flush=True)
        sums = {c: [rk["checksum"] for rk in r["ranks"]] for c, r in results.items()
                if "ranks" in r and c != "from_pretrained"}
        if len({tuple(v) for v in sums.values()}) > 1:
            print(f"WARNING: the configs loaded different values: {sums}")
        print(format_table(args, sizes, results))
        if args.json:
            write_json(args.json, args, {"sizes": sizes}, results)
        return 1 if any("error" in r for r in results.values()) else 0
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
