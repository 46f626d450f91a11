"""A Hugging Face Llama sharded per decoder layer, trained beside the same
model under PyTorch's fully_shard: what users of transformers do with it
(tied embeddings, gradient checkpointing, the KV cache, generate, the state
dict) gives the same numbers under both; so do mixture-of-experts and
state-space families, whose parameters and control flow differ from Llama's.
(Tensor parallelism and compiled blocks with our own model:
test_tensor_parallel.py, test_compile.py.)"""

from __future__ import annotations

import pytest
import torch

from shardwise.testing import multi_rank, run_on_ranks

pytest.importorskip("transformers", reason="transformers is in the test extras")


def _llama() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      tie_word_embeddings=True, attn_implementation="sdpa")
    return LlamaForCausalLM(cfg)


def _train(model, dp_rank: int, use_cache: bool = False):
    """Three AdamW steps on this data-parallel rank's batches: per step the
    loss, the router's auxiliary loss (None without one) and every full
    gradient."""
    vocab = model.config.vocab_size
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    out = []
    for step in range(3):
        ids = torch.randint(0, vocab, (2, 16), generator=torch.Generator().manual_seed(10 * step + dp_rank))
        res = model(input_ids=ids, labels=ids, use_cache=use_cache)
        res.loss.backward()
        grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
        aux = getattr(res, "aux_loss", None)
        out.append((res.loss.detach(), None if aux is None else aux.detach(), grads))
    return out


def _compare(runs, exact: bool = False):
    tol = {"rtol": 0, "atol": 0} if exact else {}
    for (loss, aux, grads), (ref_loss, ref_aux, ref_grads) in zip(runs["shardwise"], runs["torch"], strict=True):
        torch.testing.assert_close(loss, ref_loss, **tol)
        assert (aux is None) == (ref_aux is None)
        if aux is not None:
            torch.testing.assert_close(aux, ref_aux, msg="aux_loss", **tol)
        assert grads.keys() == ref_grads.keys()
        for name in grads:
            torch.testing.assert_close(grads[name], ref_grads[name], msg=name, **tol)


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


# Tiny configs of families unlike Llama: fused 3-D expert weights indexed per
# routed expert (each rank routes its own tokens, so ranks use different
# experts), a router's auxiliary loss, shared experts after a dense first
# layer and multi-head latent attention (DeepSeek-V3), attention sinks and
# expert biases (gpt-oss), a selective state-space scan with a causal
# convolution and no attention at all (Mamba-2).
_FAMILIES = {
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2, output_router_logits=True),
    "deepseek_v3": dict(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, n_shared_experts=1,
                        first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=4,
                        qk_nope_head_dim=4, v_head_dim=8, head_dim=4, n_group=2, topk_group=1),
    "gpt_oss": dict(num_local_experts=4, num_experts_per_tok=2, output_router_logits=True, sliding_window=8,
                    layer_types=["sliding_attention", "full_attention"], attn_implementation="eager"),
    "mamba2": dict(num_heads=4, head_dim=16, state_size=8, n_groups=1, expand=2, chunk_size=8,
                   attn_implementation="eager"),
}


def _family(name: str) -> torch.nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    kwargs = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=64, max_position_embeddings=64, head_dim=8,
                  attn_implementation="sdpa")
    kwargs.update(_FAMILIES[name])
    cfg = AutoConfig.for_model(name, **kwargs)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg)


@pytest.mark.parametrize("family,mixed", [("mixtral", True), ("deepseek_v3", False), ("gpt_oss", False),
                                          ("mamba2", False)])
@multi_rank(world_sizes=(2,))
def test_moe_and_state_space_families_match_pytorch(family, mixed):
    """Losses (the router's auxiliary loss included), every gradient and the
    trained parameters equal PyTorch's fully_shard bit for bit."""
    import torch.distributed as dist
    from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMP
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    from shardwise import MixedPrecisionPolicy, fully_shard

    runs, params = {}, {}
    for name, fs, mp_cls in (("shardwise", fully_shard, MixedPrecisionPolicy), ("torch", torch_fully_shard, TorchMP)):
        model = _family(family)
        kwargs = {"mp_policy": mp_cls(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)} if mixed else {}
        layers = model.backbone.layers if family == "mamba2" else model.model.layers
        for layer in layers:
            fs(layer, **kwargs)
        fs(model, **kwargs)
        runs[name] = _train(model, dist.get_rank())
        params[name] = {n: p.full_tensor() for n, p in model.named_parameters()}
    _compare(runs, exact=True)
    assert all((aux is not None) == (family in ("mixtral", "gpt_oss")) for _, aux, _ in runs["shardwise"])
    assert params["shardwise"].keys() == params["torch"].keys()
    for n, p in params["shardwise"].items():
        assert torch.equal(p, params["torch"][n]), n


@multi_rank(world_sizes=(4,))
def test_llama_with_tensor_parallel_layers_matches_pytorch():
    """A Llama whose decoder layers are tensor-parallel (torch's
    ``parallelize_module``: attention and MLP column- then row-wise over a
    ``tp`` mesh dimension), sharded per layer over ``dp``: losses, gradients,
    placements and the full state dict as under PyTorch's fully_shard."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard as torch_fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from shardwise import fully_shard

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dp_rank = mesh["dp"].get_local_rank()
    plan = {f"{block}.{name}": style() for block, names, style in (
        ("self_attn", ("q_proj", "k_proj", "v_proj"), ColwiseParallel), ("self_attn", ("o_proj",), RowwiseParallel),
        ("mlp", ("gate_proj", "up_proj"), ColwiseParallel), ("mlp", ("down_proj",), RowwiseParallel),
    ) for name in names}
    runs, extra = {}, {}
    for name, fs in (("shardwise", fully_shard), ("torch", torch_fully_shard)):
        model = _llama()
        for layer in model.model.layers:
            parallelize_module(layer, mesh["tp"], plan)
            fs(layer, mesh=mesh["dp"])
        fs(model, mesh=mesh["dp"])
        runs[name] = _train(model, dp_rank)
        placements = [(n, p.device_mesh.mesh_dim_names, p.placements) for n, p in model.named_parameters()]
        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
        extra[name] = (placements, full)
    _compare(runs)
    placements, full = extra["shardwise"]
    ref_placements, ref_full = extra["torch"]
    assert placements == ref_placements
    assert any(len(p) == 2 for _, _, p in placements)  # some parameters are sharded over dp and tp
    assert list(full) == list(ref_full)
    for k in full:
        assert torch.equal(full[k], ref_full[k]), k


def _mixtral_steps(lib: str, path: str, resume: bool):
    """Mixtral sharded by ``lib`` ("torch" or "shardwise"): two AdamW steps
    from scratch then a DCP save to ``path`` (model and optimizer, through
    torch's state-dict API), or a load from ``path`` then the next two steps.
    Every world size sees the same global batch of 12 rows."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    if lib == "torch":
        from torch.distributed.fsdp import fully_shard
    else:
        from shardwise import fully_shard
    model = _family("mixtral")
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    if resume:
        model_sd, optim_sd = get_state_dict(model, opt)
        dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
        set_state_dict(model, opt, model_state_dict=model_sd, optim_state_dict=optim_sd)
    losses = []
    for step in range(2, 4) if resume else range(2):
        batch = torch.randint(0, 64, (12, 10), generator=torch.Generator().manual_seed(step))
        ids = batch[dist.get_rank():: dist.get_world_size()]
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    if not resume:
        model_sd, optim_sd = get_state_dict(model, opt)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    return losses, {n: p.full_tensor() for n, p in model.named_parameters()}


def test_mixtral_checkpoints_pass_between_libraries_and_world_sizes(tmp_path):
    """A DCP checkpoint of Mixtral (model and AdamW state) saved at 2 ranks
    under either library resumes at 3 ranks under either, where 4 experts
    split unevenly (2, 2, 0): the losses and parameters are those of
    PyTorch's fully_shard saving and resuming."""
    saved = {}
    for lib in ("torch", "shardwise"):
        saved[lib] = run_on_ranks(_mixtral_steps, 2, lib=lib, path=str(tmp_path / lib), resume=False)[0]
    resumed = {
        (by, into): run_on_ranks(_mixtral_steps, 3, lib=into, path=str(tmp_path / by), resume=True)[0]
        for by in ("torch", "shardwise") for into in ("torch", "shardwise")
    }
    for (losses, params), (ref_losses, ref_params) in (
        (saved["shardwise"], saved["torch"]),
        *((resumed[key], resumed[("torch", "torch")]) for key in resumed),
    ):
        assert all(torch.equal(a, b) for a, b in zip(losses, ref_losses, strict=True))
        assert params.keys() == ref_params.keys()
        for name, p in params.items():
            assert torch.equal(p, ref_params[name]), name
