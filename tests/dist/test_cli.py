"""`shardwise train` end to end on 2 local gloo ranks: train, stop, resume
(the same losses as an uninterrupted run), export (loads into an unsharded
model and equals the last checkpoint), plot, summary; and a checkpoint of
another model is refused before any rank starts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SRC = Path(__file__).resolve().parents[2] / "src"
# small and quick: startup (two spawned ranks importing torch) dominates
TINY = ["--nproc", "2", "--dim", "32", "--n-layers", "2", "--n-heads", "2", "--seq-len", "16",
        "--batch-size", "4", "--steps", "6", "--warmup-steps", "2", "--lr", "1e-2"]


def _train(*args: str, timeout: float = 120) -> str:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(SRC) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run([sys.executable, "-m", "shardwise", "train", *TINY, *args], env=env, capture_output=True,
                          text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def _losses(path: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("cli")
    straight = _train("--metrics", str(tmp / "straight.jsonl"))
    ck = tmp / "ck"
    # (at --log-level warning: "stopped at step 3" is an INFO record; test_resume_anywhere reads it)
    stopped = _train("--stop-at", "3", "--checkpoint-dir", str(ck), "--metrics", str(tmp / "resumed.jsonl"),
                     "--log-level", "warning")
    resumed = _train("--resume", "--checkpoint-dir", str(ck), "--checkpoint-every", "3", "--metrics",
                     str(tmp / "resumed.jsonl"), "--export", str(tmp / "model.safetensors"), "--plot",
                     str(tmp / "plot.png"))
    return tmp, straight, stopped, resumed


def test_trains_and_reports(runs):
    tmp, straight, _, _ = runs
    losses = _losses(tmp / "straight.jsonl")
    assert len(losses) == 6 and losses[-1] < losses[0]
    assert "2 ranks (gloo, cpu), full shard" in straight
    # summary: each rank's model state next to an unsharded copy's, and the planner's (equal here)
    rows = [line.split() for line in straight.splitlines() if line[:2] in ("0 ", "1 ")]
    assert len(rows) == 2
    for row in rows:
        held, unsharded, share, planned = " ".join(row[1:3]), " ".join(row[3:5]), row[5], " ".join(row[6:8])
        assert held == planned and held != unsharded and share.endswith("%")


def test_resume_repeats_the_uninterrupted_losses(runs):
    tmp, _, stopped, resumed = runs
    # the header, progress and summary are INFO records of shardwise.train (rank 0's, in a spawned rank)
    assert stopped == ""
    assert "resume" in resumed and "step-00000003" in resumed
    assert _losses(tmp / "resumed.jsonl") == _losses(tmp / "straight.jsonl")
    assert sorted(p.name for p in (tmp / "ck").iterdir()) == ["step-00000003", "step-00000006"]


def test_export_loads_into_an_unsharded_model(runs):
    from shardwise import checkpoint
    from shardwise.checkpoint.safetensors_format import load_file
    from shardwise.models import GPT, GPTConfig

    tmp, *_ = runs
    cfg = GPTConfig(vocab_size=256, seq_len=16, dim=32, n_layers=2, n_heads=2)
    exported = GPT(cfg)
    exported.load_state_dict(load_file(tmp / "model.safetensors"), strict=True)
    final = GPT(cfg)
    checkpoint.load(checkpoint.latest(tmp / "ck"), final)
    for (name, a), (_, b) in zip(exported.state_dict().items(), final.state_dict().items()):
        assert torch.equal(a, b), name
    x = torch.randint(0, 256, (2, 16))
    assert torch.isfinite(GPT.loss(exported(x), x)).item()
    png = (tmp / "plot.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"


def test_checkpoint_of_another_model_is_refused_before_ranks_start(runs, capsys):
    from shardwise.cli import main

    tmp, *_ = runs
    with pytest.raises(SystemExit) as exc:
        main(["train", *TINY, "--dim", "48", "--resume", "--checkpoint-dir", str(tmp / "ck")])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "is of another model" in err and "tok_emb.weight is [256, 32] there but [256, 48] here" in err
    # an existing run's checkpoints are not silently mixed with a fresh run's
    with pytest.raises(SystemExit):
        main(["train", *TINY, "--checkpoint-every", "2", "--checkpoint-dir", str(tmp / "ck")])
    assert "pass --resume to continue it" in capsys.readouterr().err
