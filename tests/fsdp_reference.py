"""Shared by the tests that run one scenario under shardwise and under
PyTorch's own FSDP2 and compare (tests/dist/test_review_findings*.py): a small
model and the two ``fully_shard`` functions. Importable by the test ranks
because tests/conftest.py puts this folder on ``sys.path``."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    def __init__(self, dim=8):
        super().__init__()
        self.lin1 = nn.Linear(dim, dim)
        self.lin2 = nn.Linear(dim, dim)

    def forward(self, x):
        return self.lin2(F.relu(self.lin1(x)))


class Net(nn.Module):
    def __init__(self, dim=8, n=2):
        super().__init__()
        self.inp = nn.Linear(dim, dim)
        self.blocks = nn.ModuleList(Block(dim) for _ in range(n))
        self.out = nn.Linear(dim, 3)

    def forward(self, x):
        x = self.inp(x)
        for b in self.blocks:
            x = b(x)
        return self.out(x)


def _x(step=0, dim=8, n=4):
    """This rank's input for ``step``."""
    g = torch.Generator().manual_seed(100 * step + dist.get_rank())
    return torch.randn(n, dim, generator=g)


def _sw():
    from shardwise import fully_shard

    return fully_shard


def _pt():
    from torch.distributed.fsdp import fully_shard

    return fully_shard
