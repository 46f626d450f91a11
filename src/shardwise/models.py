"""A small GPT-style language model used by the tests, the training example and the benchmarks.

The model is deliberately plain (pre-norm blocks, ``scaled_dot_product_attention``, tied
embeddings) and fully deterministic:

* ``GPT(cfg)`` builds its submodules on the meta device, materialises them on the current
  default device and then calls :meth:`GPT.init_weights`, which is the *only* consumer of
  torch's global RNG.  Hence, under the same seed,
  ``with torch.device("meta"): m = GPT(cfg)`` followed by ``m.to_empty(device=...)`` and
  ``m.init_weights()`` gives exactly the weights of an eager ``GPT(cfg)`` - also after the
  blocks have been wrapped/sharded, since initialisation walks modules in construction order.
* :func:`synthetic_batch` makes token batches from its own ``torch.Generator`` and never
  touches the global RNG.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor, nn

if TYPE_CHECKING:
    from typing_extensions import Self

__all__ = ["INIT_STD", "GPTConfig", "Block", "GPT", "init_module_", "synthetic_batch"]

INIT_STD = 0.02
"""Standard deviation of the GPT-2 style normal init of Linear and Embedding weights."""

_POSITIVE_INT_FIELDS = ("vocab_size", "seq_len", "dim", "n_layers", "n_heads", "mlp_ratio")


@dataclass
class GPTConfig:
    """Hyper-parameters of :class:`GPT`; validated on construction."""

    vocab_size: int = 256
    seq_len: int = 64
    dim: int = 128
    n_layers: int = 4
    n_heads: int = 4
    mlp_ratio: int = 4
    tie_embeddings: bool = True
    dropout: float = 0.0

    def __post_init__(self) -> None:
        for name in _POSITIVE_INT_FIELDS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                default = type(self).__dataclass_fields__[name].default
                raise ValueError(
                    f"GPTConfig.{name}={value!r} is invalid: it must be an int >= 1 "
                    f"(e.g. {name}={default})"
                )
        if self.dim % self.n_heads:
            suggestion = -(-self.dim // self.n_heads) * self.n_heads
            raise ValueError(
                f"GPTConfig.dim={self.dim} is not divisible by n_heads={self.n_heads}: "
                f"use a multiple of n_heads (e.g. dim={suggestion}) or an n_heads that divides dim"
            )
        if not isinstance(self.tie_embeddings, bool):
            raise ValueError(
                f"GPTConfig.tie_embeddings={self.tie_embeddings!r} is invalid: pass True or False"
            )
        if isinstance(self.dropout, bool) or not isinstance(self.dropout, (int, float)) or not (
            0.0 <= self.dropout < 1.0
        ):
            raise ValueError(
                f"GPTConfig.dropout={self.dropout!r} is invalid: it must be a float in [0, 1) "
                "(e.g. dropout=0.0)"
            )

    @property
    def head_dim(self) -> int:
        """Width of one attention head."""
        return self.dim // self.n_heads


@torch.no_grad()
def init_module_(module: nn.Module) -> None:
    """Initialise ``module``'s own parameters (not its children's) in place, GPT-2 style.

    Linear / Embedding weights ~ N(0, INIT_STD), biases = 0, LayerNorm weight = 1, bias = 0.
    Works on plain tensors and on DTensors; modules of other types are left untouched.
    """
    if isinstance(module, (nn.Linear, nn.Embedding)):
        module.weight.normal_(0.0, INIT_STD)
        bias = getattr(module, "bias", None)
        if bias is not None:
            bias.zero_()
    elif isinstance(module, nn.LayerNorm):
        if module.weight is not None:
            module.weight.fill_(1.0)
        if module.bias is not None:
            module.bias.zero_()


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.dropout = cfg.dropout
        self.attn_norm = nn.LayerNorm(cfg.dim)
        self.qkv = nn.Linear(cfg.dim, 3 * cfg.dim)
        self.out_proj = nn.Linear(cfg.dim, cfg.dim)
        self.mlp_norm = nn.LayerNorm(cfg.dim)
        self.mlp = nn.Sequential(
            nn.Linear(cfg.dim, cfg.mlp_ratio * cfg.dim),
            nn.GELU(),
            nn.Linear(cfg.mlp_ratio * cfg.dim, cfg.dim),
        )

    def init_weights(self) -> None:
        """Re-initialise this block's parameters in construction order (see ``init_module_``)."""
        for module in self.modules():
            init_module_(module)

    def forward(self, x: Tensor) -> Tensor:
        """Map ``x[B, T, dim]`` to a tensor of the same shape."""
        batch, seq, dim = x.shape
        p = self.dropout if self.training else 0.0
        qkv = self.qkv(self.attn_norm(x)).view(batch, seq, 3, self.n_heads, dim // self.n_heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # each [B, heads, T, head_dim]
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        y = y.transpose(1, 2).reshape(batch, seq, dim)
        x = x + F.dropout(self.out_proj(y), p, self.training)
        return x + F.dropout(self.mlp(self.mlp_norm(x)), p, self.training)


class GPT(nn.Module):
    """Decoder-only transformer LM: token + position embeddings, ``n_layers`` blocks, head."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        device = torch.get_default_device()
        # Build on meta so PyTorch's default initialisers neither draw from the RNG nor
        # cost time; init_weights() below is then the only RNG consumer.
        with torch.device("meta"):
            self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.dim)
            self.pos_emb = nn.Embedding(cfg.seq_len, cfg.dim)
            self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
            self.norm = nn.LayerNorm(cfg.dim)
            self.lm_head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        self.tie_weights()
        if device.type != "meta":
            self.to_empty(device=device)
            self.init_weights()

    def tie_weights(self) -> None:
        """Make ``lm_head.weight`` the very Parameter ``tok_emb.weight`` (if ``tie_embeddings``)."""
        if self.cfg.tie_embeddings:
            self.lm_head.weight = self.tok_emb.weight

    def to_empty(self, *, device: torch.device | str | int | None, recurse: bool = True) -> Self:
        """``nn.Module.to_empty`` that keeps the embedding tie (the base version breaks it)."""
        super().to_empty(device=device, recurse=recurse)
        self.tie_weights()
        return self

    def init_weights(self) -> None:
        """(Re-)initialise every parameter, module by module in construction order.

        Deterministic given torch's RNG state; with ``tie_embeddings`` the shared weight is
        initialised once, as ``tok_emb.weight``.  Call after ``to_empty()`` to materialise a
        model built on the meta device.
        """
        for module in self.modules():
            if module is self.lm_head and self.cfg.tie_embeddings:
                continue
            init_module_(module)

    def forward(self, idx: Tensor) -> Tensor:
        """Map int64 tokens ``idx[B, T]`` (T <= seq_len) to logits ``[B, T, vocab_size]``."""
        if idx.dim() != 2 or idx.size(1) > self.cfg.seq_len:
            raise ValueError(
                f"GPT.forward expects idx of shape [B, T] with T <= seq_len={self.cfg.seq_len}, "
                f"got {tuple(idx.shape)}"
            )
        pos = torch.arange(idx.size(1), device=idx.device)
        x = self.tok_emb(idx) + self.pos_emb(pos)
        x = F.dropout(x, self.cfg.dropout, self.training)
        for block in self.blocks:
            x = block(x)
        logits: torch.Tensor = self.lm_head(self.norm(x))
        return logits

    @staticmethod
    def loss(logits: Tensor, targets: Tensor) -> Tensor:
        """Mean next-token cross-entropy of ``logits[B, T, V]`` vs ``targets[B, T]``, in fp32."""
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), targets.reshape(-1))

    def num_params(self) -> int:
        """Number of distinct parameters (a tied weight counts once; DTensors count globally)."""
        return sum(p.numel() for p in self.parameters())


def synthetic_batch(
    cfg: GPTConfig, batch_size: int, *, seed: int, rank: int = 0
) -> tuple[Tensor, Tensor]:
    """Return ``(inputs, targets)``, int64 CPU tensors of shape ``[batch_size, cfg.seq_len]``.

    Each row is an arithmetic progression of tokens modulo ``vocab_size`` with a random start
    and a random stride in 1..8, so a model can learn it (loss falls well below ln(vocab)).
    ``targets`` is ``inputs`` shifted by one.  Deterministic per ``(seed, rank)``; uses its own
    ``torch.Generator`` and leaves the global RNG alone.
    """
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"synthetic_batch: batch_size={batch_size!r} must be an int >= 1")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
        raise ValueError(f"synthetic_batch: rank={rank!r} must be an int >= 0")
    gen = torch.Generator(device="cpu")
    gen.manual_seed((int(seed) * 0x9E3779B97F4A7C15 + rank) % 2**64)
    start = torch.randint(0, cfg.vocab_size, (batch_size, 1), generator=gen)
    stride = torch.randint(1, 9, (batch_size, 1), generator=gen)
    tokens = (start + stride * torch.arange(cfg.seq_len + 1)) % cfg.vocab_size
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
