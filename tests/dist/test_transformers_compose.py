"""A Hugging Face Llama sharded per decoder layer, trained beside the same
model under PyTorch's fully_shard: what users of transformers do with it
(tied embeddings, gradient checkpointing, the KV cache, generate, the state
dict) gives the same numbers under both. (Tensor parallelism and compiled
blocks with our own model: test_tensor_parallel.py, test_compile.py.)"""

from __future__ import annotations

import pytest
import torch

from shardwise.testing import multi_rank

pytest.importorskip("transformers", reason="transformers is in the test extras")


def _llama() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      tie_word_embeddings=True, attn_implementation="sdpa")
    return LlamaForCausalLM(cfg)


def _train(model, dp_rank: int, use_cache: bool = False):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    out = []
    for step in range(3):
        ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(10 * step + dp_rank))
        res = model(input_ids=ids, labels=ids, use_cache=use_cache)
        res.loss.backward()
        grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
        out.append((res.loss.detach(), grads))
    return out


def _compare(runs):
    for (loss, grads), (ref_loss, ref_grads) in zip(runs["shardwise"], runs["torch"]):
        torch.testing.assert_close(loss, ref_loss)
        assert grads.keys() == ref_grads.keys()
        for name in grads:
            torch.testing.assert_close(grads[name], ref_grads[name], msg=name)


@multi_rank(world_sizes=(2,))
def test_llama_idioms_match_pytorch():
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    from shardwise import fully_shard

    runs, extra = {}, {}
    for name, fs in (("shardwise", fully_shard), ("torch", torch_fully_shard)):
        model = _llama()
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        for layer in model.model.layers:
            fs(layer)
        fs(model)
        runs[name] = _train(model, dist.get_rank(), use_cache=True)
        sd = model.state_dict()
        full = {k: v.full_tensor() for k, v in sd.items()}
        model.eval()
        with torch.no_grad():
            prompt = torch.randint(0, 128, (1, 4), generator=torch.Generator().manual_seed(1))
            generated = model.generate(prompt, max_new_tokens=4, do_sample=False)
        extra[name] = (list(sd), [type(v).__name__ for v in sd.values()], full, generated)
    _compare(runs)
    keys, types, full, generated = extra["shardwise"]
    ref_keys, ref_types, ref_full, ref_generated = extra["torch"]
    assert keys == ref_keys and types == ref_types
    for k in full:
        torch.testing.assert_close(full[k], ref_full[k], msg=k)
    assert torch.equal(generated, ref_generated)
