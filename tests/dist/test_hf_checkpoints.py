"""Hugging Face model directories in and out: ``checkpoint.load_from_file``
(and so ``shardwise train --init-from DIR``) reads ``model.safetensors`` or the
shards a ``model.safetensors.index.json`` lists, each rank only its own
chunks; ``shardwise train --model hf --init-from DIR`` builds the model from
DIR/config.json on the meta device and loads it sharded; ``checkpoint.export``
(and ``--export DIR``) writes a directory ``from_pretrained`` reads."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from shardwise.testing import assert_models_match, multi_rank

transformers = pytest.importorskip("transformers", reason="transformers is in the test extras")


def _tiny_llama(seed):
    cfg = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32,
    )
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(cfg)


def _shard(model):
    from shardwise import fully_shard

    for layer in model.model.layers:
        fully_shard(layer)
    return fully_shard(model)


@pytest.mark.parametrize("max_shard_size", ["20KB", None], ids=["index-and-shards", "one-file"])
@multi_rank(world_sizes=(2, 4))
def test_load_a_save_pretrained_directory_into_a_sharded_model(tmp_path, max_shard_size):
    """A tiny Llama saved with save_pretrained (several safetensors shards
    and an index, or one model.safetensors) loads into a sharded model built
    with other values: every parameter equals the saved one, and the outputs
    equal the saved model's."""
    from shardwise import checkpoint

    saved = _tiny_llama(seed=0)
    if dist.get_rank() == 0:
        kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
        saved.save_pretrained(tmp_path, **kwargs)
    dist.barrier()
    index = tmp_path / "model.safetensors.index.json"
    if max_shard_size:
        files = set(json.loads(index.read_text())["weight_map"].values())
        assert len(files) > 1, files  # really several shards
    else:
        assert not index.exists() and (tmp_path / "model.safetensors").is_file()

    model = _shard(_tiny_llama(seed=1))
    checkpoint.load_from_file(tmp_path, model)
    assert_models_match(model, saved, check_grads=False)
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(3))
    torch.testing.assert_close(model(ids).logits, saved(ids).logits)


@multi_rank(world_sizes=(2,))
def test_a_broken_directory_is_refused_before_the_model_is_touched(tmp_path):
    from shardwise import checkpoint
    from shardwise.errors import CheckpointError

    saved = _tiny_llama(seed=0)
    if dist.get_rank() == 0:
        saved.save_pretrained(tmp_path, max_shard_size="20KB")
        index = tmp_path / "model.safetensors.index.json"
        data = json.loads(index.read_text())
        first = next(iter(data["weight_map"]))
        data["weight_map"][first] = "model-gone.safetensors"
        index.write_text(json.dumps(data))
        (tmp_path / "empty").mkdir()
    dist.barrier()
    model = _shard(_tiny_llama(seed=1))
    before = {n: p.detach().full_tensor().clone() for n, p in model.named_parameters()}
    with pytest.raises(CheckpointError, match="model-gone.safetensors"):
        checkpoint.load_from_file(tmp_path, model)
    with pytest.raises(CheckpointError, match="without model.safetensors"):
        checkpoint.load_from_file(tmp_path / "empty", model)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.detach().full_tensor(), before[n], rtol=0, atol=0, msg=n)


# ---- shardwise train --model hf --init-from DIR / --export DIR -------------------------------
SRC = Path(__file__).resolve().parents[2] / "src"
# byte-level text needs 256 ids; 320 checks that the vocabulary comes from config.json
VOCAB = 320


def _llama_config(tie=False):
    return transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32, tie_word_embeddings=tie,
    )


def _save_llama(path, tie=False, max_shard_size="20KB", seed=0):
    """A tiny Llama saved with save_pretrained into several shards (rank 0; all wait)."""
    if dist.get_rank() == 0:
        torch.manual_seed(seed)
        transformers.LlamaForCausalLM(_llama_config(tie)).save_pretrained(path, max_shard_size=max_shard_size)
    dist.barrier()
    return path


def _train_config(**changes):
    from shardwise.train.config import TrainConfig

    base = dict(model="hf", seq_len=16, batch_size=4, steps=2, warmup_steps=1, log_every=100,
                nproc=dist.get_world_size())
    return TrainConfig(**{**base, **changes})


def _plan(cfg):
    from shardwise.train.launch import World, preflight

    return preflight(cfg, World(dist.get_world_size(), False, local_size=dist.get_world_size()))


def _tensors(path):
    """Every tensor of a Hugging Face directory, by name."""
    from safetensors.torch import load_file

    files = sorted(Path(path).glob("*.safetensors"))
    out = {}
    for f in files:
        out.update(load_file(f))
    return out


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
@multi_rank(world_sizes=(2, 4))
def test_init_from_directory_builds_on_meta_and_matches_from_pretrained(tmp_path, tie):
    """--init-from DIR with model=hf: the model comes from DIR/config.json
    (vocabulary included), is built on the meta device and sharded, each rank
    materialises only its shards, the rotary buffers are recomputed and the
    weights loaded: logits equal from_pretrained(DIR)'s."""
    from torch.distributed.tensor import DTensor

    from shardwise.checkpoint import load_from_file
    from shardwise.train.loop import _mesh
    from shardwise.train.model import build_model, shard_model

    src = _save_llama(tmp_path / "src", tie=tie)
    plan = _plan(_train_config(init_from=str(src)))
    assert plan.cfg.vocab_size == VOCAB  # from config.json, not the data's 256
    built = build_model(plan.cfg, plan.cfg.vocab_size, torch.device("cpu"))
    assert all(p.is_meta for p in built.model.parameters())  # nothing allocated yet
    shard_model(built, plan.cfg, _mesh(plan), torch.device("cpu"))
    model = built.model
    for name, p in model.named_parameters():  # each rank holds only its chunk
        assert isinstance(p, DTensor) and p.to_local().shape[0] <= -(-p.shape[0] // dist.get_world_size()), name
    load_from_file(src, model)

    ref = transformers.AutoModelForCausalLM.from_pretrained(src)
    for (name, b), (_, r) in zip(model.named_buffers(), ref.named_buffers()):
        assert torch.equal(b, r), name  # non-persistent: rotary inv_freq, original_inv_freq
    assert_models_match(model, ref, rtol=0, atol=0, check_grads=False)
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tie
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        torch.testing.assert_close(built.logits(ids), ref(ids).logits)


@multi_rank(world_sizes=(2, 4))
def test_fresh_hf_model_is_seeded_the_same_at_every_world_size(world_size):
    """Without init_from a model=hf model is initialised group by group on
    its shards, as transformers' initialize_weights would initialise the
    whole model: the same weights at every world size (and wrap)."""
    from shardwise.testing import full_tensor
    from shardwise.train.loop import _mesh
    from shardwise.train.model import build_model, shard_model

    cfg = _train_config(hf_model_type="llama", dim=32, n_layers=2, n_heads=4, seed=7)
    with torch.device("meta"):
        ref = transformers.AutoModelForCausalLM.from_config(
            transformers.AutoConfig.for_model("llama", vocab_size=256, hidden_size=32, num_hidden_layers=2,
                                              num_attention_heads=4, num_key_value_heads=4, intermediate_size=128,
                                              max_position_embeddings=16))
    ref.to_empty(device="cpu")
    torch.manual_seed(7)
    ref.initialize_weights()
    for wrap in ("blocks", "root"):
        plan = _plan(_train_config(**{**cfg.__dict__, "wrap": wrap}))
        built = build_model(plan.cfg, plan.cfg.vocab_size, torch.device("cpu"))
        shard_model(built, plan.cfg, _mesh(plan), torch.device("cpu"))
        assert_models_match(built.model, ref, rtol=0, atol=0, check_grads=False, msg=wrap)
        for (name, b), (_, r) in zip(built.model.named_buffers(), ref.named_buffers()):
            assert torch.equal(b, r), name
        norms = [full_tensor(p) for n, p in built.model.named_parameters() if n.endswith("norm.weight")]
        assert norms and all(torch.equal(n, torch.ones_like(n)) for n in norms)


def _round_trip(tmp_path, tie):
    """train --model hf --init-from DIR --lr 0 --export OUT, in this rank."""
    from shardwise.cli import _parser
    from shardwise.train.config import config_from_flags
    from shardwise.train.loop import train

    src = _save_llama(tmp_path / "src", tie=tie)
    out = tmp_path / "out"
    ns = _parser().parse_args([
        "train", "--model", "hf", "--init-from", str(src), "--lr", "0", "--min-lr", "0", "--steps", "2",
        "--warmup-steps", "1", "--seq-len", "16", "--batch-size", "4", "--nproc", str(dist.get_world_size()),
        "--export", str(out), "--export-shard-size", "30KB",
    ])
    train(_plan(config_from_flags(ns)), dist.get_rank(), torch.device("cpu"))
    dist.barrier()
    return src, out


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
@multi_rank(world_sizes=(2, 4))
def test_train_init_from_and_export_round_trip_bit_for_bit(tmp_path, tie):
    """A save_pretrained directory (several shards) through train --lr 0
    --export OUT: OUT is a Hugging Face directory (config.json, shards and
    index) whose every tensor equals the original, under the same names
    (one name per tied weight, as save_pretrained writes), and
    from_pretrained(OUT) gives the original model."""
    src, out = _round_trip(tmp_path, tie)
    names = sorted(p.name for p in out.iterdir())
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1 and names == sorted(["config.json", "generation_config.json",
                                                "model.safetensors.index.json", *shards])
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no staging left
    original, exported = _tensors(src), _tensors(out)
    for shard in shards:  # within max_shard_size, unless one tensor alone is larger
        held = [exported[n] for n, f in index["weight_map"].items() if f == shard]
        assert len(held) == 1 or sum(t.numel() * t.element_size() for t in held) <= 30_000, shard
    assert sorted(exported) == sorted(original) == sorted(index["weight_map"])
    for name, value in original.items():
        assert exported[name].dtype == value.dtype and torch.equal(exported[name], value), name
    src_index = json.loads((src / "model.safetensors.index.json").read_text())
    assert index["metadata"] == src_index["metadata"]  # total_size, total_parameters
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["vocab_size"] == VOCAB
    if dist.get_rank() == 0:
        a = transformers.AutoModelForCausalLM.from_pretrained(src)
        b = transformers.AutoModelForCausalLM.from_pretrained(out)
        assert (b.lm_head.weight is b.model.embed_tokens.weight) == tie
        for (name, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items()):
            assert torch.equal(x, y), name
        ids = torch.randint(0, VOCAB, (2, 12))
        assert torch.equal(a(ids).logits, b(ids).logits)


@multi_rank(world_sizes=(2,))
def test_export_directory_replaces_an_export_but_nothing_else(tmp_path):
    """An export directory is replaced by the next export (one file now: no
    leftover shards); a directory holding anything else, or a file at the
    path, is refused on every rank and left as it was."""
    from shardwise.checkpoint import CheckpointError, export, load_from_file

    model = _shard(_tiny_llama(seed=0))
    out = tmp_path / "out"
    export(out, model, max_shard_size="20KB")
    assert len(list(out.glob("model-*-of-*.safetensors"))) > 1
    assert export(out, model) == out
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "generation_config.json", "model.safetensors"]
    other = _shard(_tiny_llama(seed=1))
    load_from_file(out, other)
    assert_models_match(other, model, rtol=0, atol=0, check_grads=False)
    if dist.get_rank() == 0:
        (tmp_path / "mine").mkdir()
        (tmp_path / "mine" / "notes.txt").write_text("keep me")
        (tmp_path / "file").write_text("x")
    dist.barrier()
    with pytest.raises(CheckpointError, match="notes.txt.*refusing to replace it"):
        export(tmp_path / "mine", model)
    with pytest.raises(CheckpointError, match="is a file"):
        export(tmp_path / "file", model)
    with pytest.raises(ValueError, match="max_shard_size"):
        export(tmp_path / "one.safetensors", model, max_shard_size="1MB")
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file", "mine", "out"]


def _cli(*args):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(SRC) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run([sys.executable, "-m", "shardwise", "train", *args], env=env, capture_output=True,
                          text=True, timeout=300)


def test_cli_round_trip_on_two_spawned_ranks(tmp_path):
    """The command itself, as a user runs it (two spawned gloo ranks)."""
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(_llama_config()).save_pretrained(tmp_path / "src", max_shard_size="20KB")
    proc = _cli("--model", "hf", "--init-from", str(tmp_path / "src"), "--lr", "0", "--min-lr", "0",
                "--steps", "1", "--seq-len", "16", "--batch-size", "2", "--nproc", "2",
                "--export", str(tmp_path / "out"), "--export-shard-size", "20KB")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    original, exported = _tensors(tmp_path / "src"), _tensors(tmp_path / "out")
    assert sorted(original) == sorted(exported)
    assert all(torch.equal(exported[k], v) for k, v in original.items())
    transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out")


def test_broken_init_from_directories_are_refused_before_ranks_start(tmp_path, capsys):
    from shardwise.cli import main

    torch.manual_seed(0)
    transformers.LlamaForCausalLM(_llama_config()).save_pretrained(tmp_path / "src", max_shard_size="20KB")
    args = ["train", "--model", "hf", "--seq-len", "16", "--batch-size", "2", "--steps", "1", "--nproc", "2"]

    no_config = tmp_path / "no_config"
    no_config.mkdir()
    for f in (tmp_path / "src").iterdir():
        if f.name != "config.json":
            (no_config / f.name).write_bytes(f.read_bytes())
    with pytest.raises(SystemExit) as exc:
        main([*args, "--init-from", str(no_config)])
    assert exc.value.code == 2
    assert "is a directory without config.json" in capsys.readouterr().err

    index = tmp_path / "src" / "model.safetensors.index.json"
    data = json.loads(index.read_text())
    data["weight_map"][next(iter(data["weight_map"]))] = "model-gone.safetensors"
    index.write_text(json.dumps(data))
    with pytest.raises(SystemExit) as exc:
        main([*args, "--init-from", str(tmp_path / "src")])
    assert exc.value.code == 2
    assert "names 'model-gone.safetensors'" in capsys.readouterr().err

    # a config (--hf-config wins over config.json) whose shapes do not fit the weights
    (tmp_path / "wide").mkdir()
    wide = _llama_config()
    wide.hidden_size = 64
    wide.save_pretrained(tmp_path / "wide")
    index.write_text(json.dumps({**data, "weight_map": json.loads(
        (tmp_path / "no_config" / "model.safetensors.index.json").read_text())["weight_map"]}))
    with pytest.raises(SystemExit) as exc:
        main([*args, "--init-from", str(tmp_path / "src"), "--hf-config", str(tmp_path / "wide")])
    assert exc.value.code == 2
    assert "holds another model" in capsys.readouterr().err
