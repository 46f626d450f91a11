"""What `shardwise train` shows goes through logging: the library prints
nothing, the command's console handler shows rank 0's records as plain text
(--log-level), the progress bar redraws on a terminal; and a rank that fails
under torchrun leaves its exception in TORCHELASTIC_ERROR_FILE (@record)."""

from __future__ import annotations

import ast
import io
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from shardwise.errors import ConfigError
from shardwise.train.config import TrainConfig
from shardwise.train.report import ConsoleHandler, Progress, console_logging

SRC = Path(__file__).resolve().parents[2] / "src"


@pytest.fixture
def console():
    """Remove the console handler (and the level) a test installs."""
    logger = logging.getLogger("shardwise")
    level, handlers = logger.level, list(logger.handlers)
    yield
    logger.handlers[:] = handlers
    logger.setLevel(level)


def _console_stream(node: ast.expr | None) -> bool:
    return isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "sys" and (
        node.attr in ("stdout", "stderr"))


def test_the_library_prints_nothing():
    # print() only into a stream the caller hands over (the dry run's and the plan's reports);
    # the command itself (cli.py) may print its error line, and its console handler writes
    found = []
    for path in sorted((SRC / "shardwise").rglob("*.py")):
        rel = path.relative_to(SRC / "shardwise").as_posix()
        if rel == "cli.py":
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        console = {id(n) for c in ast.walk(tree) if isinstance(c, ast.ClassDef) and c.name == "ConsoleHandler"
                   for n in ast.walk(c)}
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call) or id(node) in console:
                continue
            if isinstance(node.func, ast.Name) and node.func.id == "print":
                target = next((k.value for k in node.keywords if k.arg == "file"), None)
                if target is None or _console_stream(target):
                    found.append(f"{rel}:{node.lineno}")
            elif isinstance(node.func, ast.Attribute) and node.func.attr == "write" and _console_stream(node.func.value):
                found.append(f"{rel}:{node.lineno}")
    assert not found, f"printing in library code (log through logging.getLogger('shardwise.<module>')): {found}"


def test_console_shows_bare_info_and_labelled_problems(console, capsys):
    console_logging("info")
    log = logging.getLogger("shardwise.train")
    log.info("step 1/6 | loss 5.5")
    log.debug("not shown at info")
    logging.getLogger("shardwise.checkpoint").warning("could not remove %s", "old")
    out, err = capsys.readouterr()
    assert out == "step 1/6 | loss 5.5\n"
    assert err == "warning (shardwise.checkpoint): could not remove old\n"
    console_logging("debug")  # replaces the handler: still one line per record
    log.debug("shown")
    assert capsys.readouterr().out == "shardwise.train: shown\n"
    assert sum(isinstance(h, ConsoleHandler) for h in logging.getLogger("shardwise").handlers) == 1
    console_logging("warning")
    log.info("quiet")
    log.error("broken")
    out, err = capsys.readouterr()
    assert out == "" and err == "error (shardwise.train): broken\n"
    with pytest.raises(ValueError, match="'loud' is not one of"):
        console_logging("loud")


def test_other_ranks_show_only_problems(console, capsys):
    console_logging("debug", rank=1)
    log = logging.getLogger("shardwise.train")
    log.info("rank 0 speaks for the run")
    log.warning("slow disk")
    out, err = capsys.readouterr()
    assert out == "" and err == "rank 1: warning (shardwise.train): slow disk\n"


def test_progress_logs_lines_or_redraws_on_a_terminal(console, capsys, monkeypatch):
    console_logging("info")
    p = Progress(4, every=2)  # stdout captured: not a terminal, so lines
    assert not p.live
    for step in range(1, 5):
        p.update(step, float(step), 1000.0, 2**20, 1e-3)
    p.close()
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(" |")[0] for line in lines] == ["step 1/4", "step 2/4", "step 4/4"]
    assert "loss  3.5000" in lines[2]  # the mean since the last line

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    tty = Terminal()
    monkeypatch.setattr(sys, "stdout", tty)
    p = Progress(3)
    assert p.live
    p.update(1, 1.0, 1.0, 1, 1.0)
    p.update(3, 1.0, 1.0, 1, 1.0)
    logging.getLogger("shardwise.checkpoint").info("saved checkpoint x")  # ends the live line first
    p.update(3, 1.0, 1.0, 1, 1.0)
    p.close()
    logging.getLogger("shardwise.train").info("done")
    text = tty.getvalue()
    assert text.count("\r\x1b[2K") == 3 and "\nsaved checkpoint x\n" in text and text.endswith("\ndone\n")
    assert "step 3/3" in text.split("\r\x1b[2K")[-1].splitlines()[0]


def test_progress_without_a_console_is_plain_log_records(console, caplog):
    caplog.set_level(logging.INFO, logger="shardwise.train")
    p = Progress(2)
    assert not p.live  # no handler that redraws: one record per line
    p.update(1, 2.0, 1.0, 1, 1.0)
    p.update(2, 1.0, 1.0, 1, 1.0)
    assert [r.getMessage().split(" |")[0] for r in caplog.records] == ["step 1/2", "step 2/2"]
    assert all(r.name == "shardwise.train" for r in caplog.records)


def test_log_level_is_a_flag_and_a_toml_key(tmp_path):
    from shardwise.cli import _parser
    from shardwise.train.config import config_from_flags, load_toml

    assert TrainConfig().log_level == "info"
    toml = tmp_path / "run.toml"
    toml.write_text('[output]\nlog_level = "warning"\n')
    assert load_toml(toml) == {"log_level": "warning"}
    ns = _parser().parse_args(["train", str(toml)])
    assert config_from_flags(ns).log_level == "warning"
    ns = _parser().parse_args(["train", str(toml), "--log-level", "debug"])
    assert config_from_flags(ns).log_level == "debug"
    with pytest.raises(ConfigError, match="log_level='loud' is not one of debug, info, warning, error"):
        TrainConfig(log_level="loud")


def test_a_failing_rank_writes_torchelastic_error_file(tmp_path):
    # torchrun sets TORCHELASTIC_ERROR_FILE per rank; main() is decorated with @record
    error_file = tmp_path / "error.json"
    code = (
        "import shardwise.cli as cli\n"
        "def fail(cfg):\n"
        "    raise RuntimeError('rank 3 ran out of luck')\n"
        "cli.train_command = fail\n"
        "cli.main(['train'])\n"
    )
    env = {**os.environ, "TORCHELASTIC_ERROR_FILE": str(error_file),
           "PYTHONPATH": str(SRC) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and "rank 3 ran out of luck" in proc.stderr
    message = json.loads(error_file.read_text())["message"]
    assert message["message"] == "RuntimeError: rank 3 ran out of luck"
    assert "def fail" in message["extraInfo"]["py_callstack"] or "in fail" in message["extraInfo"]["py_callstack"]
    # a configuration mistake is not a crash: exit status 2, no error file
    error_file.unlink()
    proc = subprocess.run([sys.executable, "-m", "shardwise", "train", "--steps", "0"], env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "steps=0" in proc.stderr and not error_file.exists()
