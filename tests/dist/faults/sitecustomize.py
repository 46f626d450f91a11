"""Faults for tests/dist/test_watchdog.py, injected into every process of a
`shardwise train` run started with this directory on PYTHONPATH and
SHARDWISE_TEST_FAULT set (a JSON object); the library reads no such
variable. Python imports ``sitecustomize`` at start-up, so the spawned ranks
(and torchrun's workers) patch ``shardwise.train.loop`` before they run.

Keys: ``dir``: each rank writes ``rank<R>.pid`` once and ``rank<R>.step``
(its current step) every step there; ``faults``: a list of
``{"rank": R or "all", "step": S, "do": D, "seconds": T}`` with D one of
``raise`` (a RuntimeError), ``block`` (wait forever outside any collective,
as a deadlocked data loader would), ``sleep`` (``seconds`` before the step:
a slow step) and ``slow_save`` (``seconds`` before the checkpoint save of
step S).
"""

from __future__ import annotations

import json
import os


def _install(spec: dict) -> None:
    import threading
    import time
    from pathlib import Path

    import shardwise.train.loop as loop

    out = Path(spec["dir"])
    faults = spec.get("faults", [])
    train_step, save = loop._Run.train_step, loop._Run._save

    def matching(run, kind):
        return [f for f in faults if f["do"] in kind and f["step"] == run.step and f["rank"] in ("all", run.rank)]

    def blocked_forever_in_a_data_loader():
        threading.Event().wait()

    def patched_train_step(self, lr):
        if not (out / f"rank{self.rank}.pid").exists():
            (out / f"rank{self.rank}.pid").write_text(str(os.getpid()))
        (out / f"rank{self.rank}.step").write_text(str(self.step))
        for fault in matching(self, ("raise", "block", "sleep")):
            if fault["do"] == "raise":
                raise RuntimeError(f"injected fault on rank {self.rank} at step {self.step}")
            if fault["do"] == "block":
                blocked_forever_in_a_data_loader()
            time.sleep(fault["seconds"])
        return train_step(self, lr)

    def patched_save(self):
        for fault in matching(self, ("slow_save",)):
            time.sleep(fault["seconds"])
        return save(self)

    loop._Run.train_step = patched_train_step
    loop._Run._save = patched_save


if os.environ.get("SHARDWISE_TEST_FAULT"):
    _install(json.loads(os.environ["SHARDWISE_TEST_FAULT"]))
