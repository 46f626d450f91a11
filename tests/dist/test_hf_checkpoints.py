"""Hugging Face model directories in: ``checkpoint.load_from_file`` (and so
``shardwise train --init-from DIR``) reads ``model.safetensors`` or the shards
a ``model.safetensors.index.json`` lists, each rank only its own chunks."""

from __future__ import annotations

import json

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
