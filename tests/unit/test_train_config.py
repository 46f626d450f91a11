"""`shardwise train` settings: TOML + flags, validation, and the errors a user
sees before any rank starts (missing data, unknown keys, --nproc vs batch)."""

from __future__ import annotations

import pytest

from shardwise.cli import main
from shardwise.errors import ConfigError
from shardwise.train.config import TrainConfig, load_toml, render_toml, resolve


def _toml(tmp_path, text):
    path = tmp_path / "run.toml"
    path.write_text(text)
    return path


def test_flags_override_toml_override_defaults(tmp_path, capsys):
    path = _toml(tmp_path, 'steps = 7\n[model]\ndim = 64\nn_heads = 2\n[optim]\nlr = 1e-3\n[data]\ndata = []\n')
    values = load_toml(path)
    assert values == {"steps": 7, "dim": 64, "n_heads": 2, "lr": 1e-3, "data": []}
    cfg = resolve(values, {"steps": 9})
    assert (cfg.steps, cfg.dim, cfg.lr, cfg.seq_len) == (9, 64, 1e-3, TrainConfig().seq_len)
    main(["train", str(path), "--steps", "3", "--nproc", "1", "--batch-size", "2", "--dry-run"])
    out = capsys.readouterr().out
    assert "steps = 3" in out and "dim = 64" in out and "nothing allocated" in out


def test_rendered_toml_reads_back(tmp_path):
    cfg = TrainConfig(dim=96, n_heads=3, data=("a.txt", "b dir"), offload=True, export="m.safetensors")
    assert resolve(load_toml(_toml(tmp_path, render_toml(cfg))), {}) == cfg


def test_unknown_key_names_the_nearest(tmp_path):
    with pytest.raises(ConfigError, match="'learning_rate' is not a configuration key; the nearest valid key is 'lr'"):
        load_toml(_toml(tmp_path, "learning_rate = 0.1\n"))
    with pytest.raises(ConfigError, match="nearest valid key is 'n_layers'"):
        load_toml(_toml(tmp_path, "[model]\nn_layer = 2\n"))
    with pytest.raises(ConfigError, match="nearest valid key is 'seq_len'"):
        load_toml(_toml(tmp_path, "seq-len = 32\n"))
    with pytest.raises(ConfigError, match=r"nearest valid one is \[optim\]"):
        load_toml(_toml(tmp_path, "[optimizer]\nlr = 0.1\n"))
    with pytest.raises(ConfigError, match=r"'lr' belongs in \[optim\]"):
        load_toml(_toml(tmp_path, "[model]\nlr = 0.1\n"))


def test_values_are_checked_with_the_fix():
    with pytest.raises(TypeError, match=r"steps='10' must be an integer"):
        TrainConfig(steps="10")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="dim=100 is not divisible by n_heads=3.*dim=102"):
        TrainConfig(dim=100, n_heads=3)
    with pytest.raises(ValueError, match=r"strategy='fsdp' is not one of"):
        TrainConfig(strategy="fsdp")
    with pytest.raises(ValueError, match="min_lr=0.1 exceeds lr"):
        TrainConfig(min_lr=0.1, lr=0.01)
    with pytest.raises(ValueError, match="stop_at=20 is past steps=10"):
        TrainConfig(stop_at=20, steps=10)
    assert TrainConfig(lr=1).lr == 1.0  # an int where a float is expected is fine


def test_micro_batch_splits_the_global_batch():
    cfg = TrainConfig(batch_size=16, grad_accum=2)
    assert cfg.micro_batch(2) == 4 and cfg.micro_batch(8) == 1
    with pytest.raises(ConfigError, match=r"cannot be split evenly over 3 ranks x grad_accum=2.*ranks in \{1, 2, 4, 8\}"):
        cfg.micro_batch(3)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--data", "/no/such/file.txt"], "data='/no/such/file.txt' does not exist"),
        (["--nproc", "32"], "batch_size=16 sequences cannot be split evenly over 32 ranks"),
        (["--nproc", "3"], "use a number of ranks in {1, 2, 4, 8, 16} (--nproc"),
        (["--strategy", "hybrid", "--shard-size", "3", "--device", "cpu"], "shard groups must divide the world"),
        (["--shard-size", "2"], "only applies to strategy='hybrid'"),
        (["--init-from", "/no/model.safetensors"], "init_from='/no/model.safetensors' does not exist"),
    ],
)
def test_cli_reports_mistakes_before_any_rank_starts(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["train", *argv])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("shardwise train: error: ") and message in err


def test_cli_unknown_toml_key_and_missing_file(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["train", str(_toml(tmp_path, "[parallel]\nstrategi = 'full'\n"))])
    assert "the nearest valid key is 'strategy'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["train", str(tmp_path / "absent.toml")])
    assert "does not exist" in capsys.readouterr().err


def test_cli_unknown_flag_is_argparse_error(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["train", "--n-layer", "2x"])
    assert exc.value.code == 2


@pytest.mark.parametrize(
    "argv, nearest",
    [
        (["train", "--stpes", "3"], "--steps"),
        (["train", "--learning-rate=1e-3"], "--lr"),  # another trainer's name
        (["train", "--max-iters", "9"], "--steps"),
        (["train", "--no-offlaod"], "--no-offload"),
        (["train", "--watchdog-timout", "60"], "--watchdog-timeout"),
        (["plan", "--jsn", "x.json"], "--json"),
    ],
)
def test_cli_unknown_flag_names_the_nearest_valid_one(argv, nearest, capsys):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    flag = argv[1].split("=")[0]
    assert capsys.readouterr().err == (f"shardwise {argv[0]}: error: unknown flag {flag}; the nearest valid flag is "
                                       f"{nearest} (`shardwise {argv[0]} --help` lists them all)\n")


def test_cli_extra_argument_is_an_error(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["train", "a.toml", "b.toml"])
    assert exc.value.code == 2 and "unexpected argument 'b.toml'" in capsys.readouterr().err


@pytest.mark.parametrize("value", [-1.0, 1.0, float("nan")])
def test_watchdog_timeout_is_zero_or_at_least_the_minimum(value):
    with pytest.raises(ConfigError, match=r"watchdog_timeout=.* must be 0 \(off\) or a number of seconds >= 2"):
        TrainConfig(watchdog_timeout=value)
    assert TrainConfig(watchdog_timeout=0).watchdog_timeout == 0.0
    assert TrainConfig(watchdog_timeout=15).watchdog_timeout == 15.0


def test_transformers_missing_is_a_clear_error(monkeypatch, capsys):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "transformers" else real(name, *a))
    with pytest.raises(SystemExit):
        main(["train", "--model", "hf", "--dry-run"])
    assert "needs the 'transformers' package" in capsys.readouterr().err


def test_dry_run_prints_plan_for_many_ranks_without_allocating(capsys, monkeypatch):
    # 1024 ranks under torchrun's environment: nothing starts, nothing is allocated
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1024")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    main(["train", "--dry-run", "--device", "cpu", "--batch-size", "1024", "--dim", "256", "--n-layers", "8",
          "--n-heads", "4", "--strategy", "hybrid", "--precision", "bf16"])
    out = capsys.readouterr().out
    assert "1024 ranks" in out and "shard_size = 8" in out
    assert "the 128 replicas of the hybrid mesh" in out


def test_readme_example_toml_is_valid():
    import re
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    blocks = re.findall(r"```toml\n(.*?)```", readme, flags=re.S)
    assert blocks, "README.md shows an example TOML"
    for block in blocks:
        from shardwise.train.config import _toml_module, resolve

        raw = _toml_module().loads(block)  # tomllib, or tomli on Python 3.10
        flat = {k: v for section in raw.values() for k, v in section.items()}
        cfg = resolve(flat, {})
        assert cfg.micro_batch(cfg.nproc) >= 1


def test_toml_on_python_310_reads_through_tomli(tmp_path, monkeypatch):
    # Python 3.10 has no tomllib: load_toml uses the tomli dependency (same API)
    import sys
    import types

    import shardwise.train.config as config

    real = config._toml_module()
    fake = types.ModuleType("tomli")
    calls = []
    fake.loads = lambda text: calls.append(text) or real.loads(text)  # type: ignore[attr-defined]
    fake.TOMLDecodeError = real.TOMLDecodeError  # type: ignore[attr-defined]
    monkeypatch.setattr(sys, "version_info", (3, 10, 14, "final", 0))
    monkeypatch.setitem(sys.modules, "tomli", fake)
    assert load_toml(_toml(tmp_path, "steps = 5\n")) == {"steps": 5} and calls
    monkeypatch.setitem(sys.modules, "tomli", None)  # not installed: a clear error naming the fix
    with pytest.raises(ConfigError, match="needs the 'tomli' package.*pip install"):
        load_toml(_toml(tmp_path, "steps = 5\n"))


def test_checkpoint_async_is_a_flag_and_a_key(tmp_path):
    from shardwise.cli import _parser
    from shardwise.train.config import config_from_flags

    assert TrainConfig().checkpoint_async is False
    assert load_toml(_toml(tmp_path, "[checkpoint]\ncheckpoint_async = true\n")) == {"checkpoint_async": True}
    for flags, want in ((["--checkpoint-async"], True), (["--no-checkpoint-async"], False), ([], False)):
        ns, _ = _parser().parse_known_args(["train", *flags])
        assert config_from_flags(ns).checkpoint_async is want
