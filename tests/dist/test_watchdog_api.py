"""shardwise.watchdog used without the command: two gloo ranks of a plain
training loop, one of which enters a collective the other never joins. Both
watchdogs see every rank waiting, in different collectives, end the run
(exit status 124 on both) and hand the same report to ``on_timeout``."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src"

SCRIPT = r'''
import sys, time
from datetime import timedelta
import torch, torch.distributed as dist, torch.multiprocessing as mp
from shardwise.watchdog import Watchdog

def rank_main(rank, port, out):
    store = dist.TCPStore("127.0.0.1", port, None, False, timeout=timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    other = dist.new_group([0, 1])

    def on_timeout(report):
        with open(f"{out}/report{rank}.txt", "w") as fh:
            fh.write(f"reporter={report.reporter} stuck={list(report.stuck)}\n{report.message}")

    with Watchdog(timeout=3, on_timeout=on_timeout) as wd:
        for step in range(1, 1000):
            wd.step(step)
            grads = torch.ones(4)
            if step == 5 and rank == 1:
                with wd.collective("broadcast (weights)"):  # rank 0 never joins this one
                    dist.broadcast(grads, src=0, group=other)
            with wd.collective("all_reduce (grads)"):
                dist.all_reduce(grads)

if __name__ == "__main__":
    store = dist.TCPStore("127.0.0.1", 0, None, True, timeout=timedelta(seconds=60), wait_for_workers=False)
    ctx = mp.start_processes(rank_main, args=(store.port, sys.argv[1]), nprocs=2, join=False, start_method="spawn")
    for p in ctx.processes:
        p.join(120)
    print("exit", [p.exitcode for p in ctx.processes])
'''


def test_ranks_in_different_collectives_end_the_run(tmp_path):
    script = tmp_path / "loop.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(SRC) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    start = time.monotonic()
    proc = subprocess.run([sys.executable, str(script), str(tmp_path)], env=env, capture_output=True, text=True,
                          timeout=180)
    took = time.monotonic() - start
    assert proc.returncode == 0 and "exit [124, 124]" in proc.stdout, proc.stdout + proc.stderr
    reports = [(tmp_path / f"report{r}.txt").read_text() for r in range(2)]
    heads = sorted(r.splitlines()[0] for r in reports)
    assert heads == ["reporter=False stuck=[0, 1]", "reporter=True stuck=[0, 1]"], heads
    message = reports[0].split("\n", 1)[1]
    assert message == reports[1].split("\n", 1)[1]
    assert "watchdog: ranks 0, 1 wait in different collectives" in message
    assert "step 5, in all_reduce (grads)" in message and "step 5, in broadcast (weights)" in message
    assert "rank 1's Python stack (most recent call last):" in message and "dist.broadcast(grads" in message
    assert took < 120
