"""Single-process tests of the example model in ``shardwise.models``."""

from __future__ import annotations

import math

import pytest
import torch

from shardwise.models import GPT, INIT_STD, GPTConfig, init_module_, synthetic_batch

SMALL = dict(vocab_size=64, seq_len=16, dim=32, n_layers=2, n_heads=4)


def _state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _assert_same_weights(a: torch.nn.Module, b: torch.nn.Module) -> None:
    sa, sb = _state(a), _state(b)
    assert sa.keys() == sb.keys()
    for name in sa:
        assert torch.equal(sa[name], sb[name]), name


def test_forward_shapes_and_loss() -> None:
    cfg = GPTConfig(**SMALL)
    model = GPT(cfg)
    inputs, targets = synthetic_batch(cfg, 3, seed=0)
    logits = model(inputs)
    assert logits.shape == (3, cfg.seq_len, cfg.vocab_size)
    assert model(inputs[:, :5]).shape == (3, 5, cfg.vocab_size)
    loss = GPT.loss(logits, targets)
    assert loss.dim() == 0 and torch.isfinite(loss)
    # freshly initialised: close to uniform over the vocabulary
    assert abs(loss.item() - math.log(cfg.vocab_size)) < 0.5
    loss.backward()
    assert all(p.grad is not None for p in model.parameters())


def test_forward_rejects_bad_input() -> None:
    cfg = GPTConfig(**SMALL)
    model = GPT(cfg)
    with pytest.raises(ValueError, match="seq_len=16"):
        model(torch.zeros(1, cfg.seq_len + 1, dtype=torch.long))
    with pytest.raises(ValueError, match=r"\[B, T\]"):
        model(torch.zeros(cfg.seq_len, dtype=torch.long))


def test_attention_is_causal() -> None:
    cfg = GPTConfig(**SMALL)
    model = GPT(cfg).eval()
    inputs, _ = synthetic_batch(cfg, 2, seed=1)
    changed = inputs.clone()
    changed[:, 10:] = (changed[:, 10:] + 1) % cfg.vocab_size
    with torch.no_grad():
        a, b = model(inputs), model(changed)
    torch.testing.assert_close(a[:, :10], b[:, :10], rtol=0, atol=1e-6)
    assert not torch.allclose(a[:, 10:], b[:, 10:])


def test_tied_weights_are_one_parameter() -> None:
    tied = GPT(GPTConfig(**SMALL))
    assert tied.lm_head.weight is tied.tok_emb.weight
    assert tied.lm_head.bias is None
    untied = GPT(GPTConfig(**SMALL, tie_embeddings=False))
    assert untied.lm_head.weight is not untied.tok_emb.weight
    assert untied.num_params() - tied.num_params() == SMALL["vocab_size"] * SMALL["dim"]
    assert tied.num_params() == sum(p.numel() for p in set(tied.parameters()))


def test_module_attributes() -> None:
    cfg = GPTConfig(**SMALL)
    model = GPT(cfg)
    assert isinstance(model.tok_emb, torch.nn.Embedding)
    assert isinstance(model.pos_emb, torch.nn.Embedding)
    assert isinstance(model.blocks, torch.nn.ModuleList) and len(model.blocks) == cfg.n_layers
    assert isinstance(model.norm, torch.nn.LayerNorm)
    assert isinstance(model.lm_head, torch.nn.Linear)
    assert [name for name, _ in model.named_children()] == [
        "tok_emb", "pos_emb", "blocks", "norm", "lm_head"
    ]


def test_init_values() -> None:
    model = GPT(GPTConfig(**SMALL, tie_embeddings=False))
    for name, p in model.named_parameters():
        if name.endswith("bias"):
            assert torch.count_nonzero(p) == 0, name
        elif "norm" in name:
            assert torch.all(p == 1), name
        else:
            assert abs(p.std().item() - INIT_STD) < 0.2 * INIT_STD, name
            assert abs(p.mean().item()) < 0.2 * INIT_STD, name


def test_eager_build_is_deterministic_given_seed() -> None:
    cfg = GPTConfig(**SMALL)
    torch.manual_seed(3)
    a = GPT(cfg)
    torch.manual_seed(3)
    b = GPT(cfg)
    _assert_same_weights(a, b)
    torch.manual_seed(4)
    c = GPT(cfg)
    assert not torch.equal(a.tok_emb.weight, c.tok_emb.weight)


@pytest.mark.parametrize("tie", [True, False])
def test_meta_build_then_init_matches_eager(tie: bool) -> None:
    cfg = GPTConfig(**SMALL, tie_embeddings=tie)
    torch.manual_seed(7)
    eager = GPT(cfg)
    rng_after_eager = torch.get_rng_state()

    torch.manual_seed(1234)  # the meta build must not depend on, nor need, the RNG
    with torch.device("meta"):
        lazy = GPT(cfg)
    assert all(p.is_meta for p in lazy.parameters())
    lazy.to_empty(device="cpu")
    assert (lazy.lm_head.weight is lazy.tok_emb.weight) == tie
    torch.manual_seed(7)
    lazy.init_weights()

    _assert_same_weights(eager, lazy)
    assert torch.equal(rng_after_eager, torch.get_rng_state())


def test_module_by_module_init_matches_eager() -> None:
    cfg = GPTConfig(**SMALL)
    torch.manual_seed(11)
    eager = GPT(cfg)
    with torch.device("meta"):
        lazy = GPT(cfg)
    lazy.to_empty(device="cpu")
    torch.manual_seed(11)
    init_module_(lazy.tok_emb)
    init_module_(lazy.pos_emb)
    for block in lazy.blocks:
        block.init_weights()
    init_module_(lazy.norm)  # lm_head is tied: nothing left to draw
    _assert_same_weights(eager, lazy)


def test_synthetic_batch_is_deterministic_and_local() -> None:
    cfg = GPTConfig(**SMALL)
    torch.manual_seed(0)
    rng_before = torch.get_rng_state()
    x1, y1 = synthetic_batch(cfg, 4, seed=5, rank=1)
    x2, y2 = synthetic_batch(cfg, 4, seed=5, rank=1)
    assert torch.equal(rng_before, torch.get_rng_state())
    assert torch.equal(x1, x2) and torch.equal(y1, y2)
    assert x1.shape == y1.shape == (4, cfg.seq_len)
    assert x1.dtype == y1.dtype == torch.int64
    assert 0 <= int(x1.min()) and int(x1.max()) < cfg.vocab_size
    assert torch.equal(x1[:, 1:], y1[:, :-1])  # targets are inputs shifted by one
    assert not torch.equal(x1, synthetic_batch(cfg, 4, seed=5, rank=0)[0])
    assert not torch.equal(x1, synthetic_batch(cfg, 4, seed=6, rank=1)[0])


@pytest.mark.parametrize(
    ("kwargs", "pattern"),
    [
        (dict(dim=30, n_heads=4), r"dim=30 .*n_heads=4.*dim=32"),
        (dict(n_layers=0), r"n_layers=0"),
        (dict(vocab_size=-1), r"vocab_size=-1"),
        (dict(seq_len=8.0), r"seq_len=8\.0"),
        (dict(n_heads=True), r"n_heads=True"),
        (dict(mlp_ratio=0), r"mlp_ratio=0"),
        (dict(dropout=1.0), r"dropout=1\.0"),
        (dict(dropout=-0.1), r"dropout=-0\.1"),
        (dict(tie_embeddings="yes"), r"tie_embeddings='yes'"),
    ],
)
def test_config_validation(kwargs: dict[str, object], pattern: str) -> None:
    with pytest.raises(ValueError, match=pattern):
        GPTConfig(**kwargs)  # type: ignore[arg-type]


def test_synthetic_batch_validation() -> None:
    cfg = GPTConfig(**SMALL)
    with pytest.raises(ValueError, match="batch_size"):
        synthetic_batch(cfg, 0, seed=0)
    with pytest.raises(ValueError, match="rank"):
        synthetic_batch(cfg, 1, seed=0, rank=-1)
