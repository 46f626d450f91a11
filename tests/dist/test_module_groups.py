"""Modules sharded together (``fully_shard([a, b, ...])``) behave as under
PyTorch's own fully_shard when only some of them run: a chunked loss whose
head is called on its own per chunk, several partial forwards before one
backward, a member that never runs, members recomputed by activation
checkpointing, and inputs cast for every member. Each scenario runs under
both and compares outputs, gradients and parameters over several steps."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from fsdp_reference import _assert_grads_equal, _assert_params_equal, _mp, _pt, _sw, _x, needs_torch
from torch.utils.checkpoint import checkpoint

from shardwise.testing import multi_rank


class Lm(nn.Module):
    """Embedding, body, then a norm and a head that the forward may skip (a
    chunked loss runs the head itself)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(64, 16)
        self.body = nn.Linear(16, 16)
        self.norm = nn.RMSNorm(16)
        self.head = nn.Linear(16, 64, bias=False)

    def forward(self, tokens: torch.Tensor, skip_head: bool = False) -> torch.Tensor:
        h = self.norm(F.relu(self.body(self.embed(tokens))))
        return h if skip_head else self.head(h)


def _both_lm(**kw):
    """(shardwise Lm, PyTorch Lm): embed, body, [norm, head] and the root sharded alike."""
    torch.manual_seed(0)
    a = Lm()
    b = copy.deepcopy(a)
    for fs, m in ((_sw(), a), (_pt(), b)):
        fs(m.embed)
        fs(m.body)
        fs([m.norm, m.head], **kw)
        fs(m)
    return a, b


def _tokens(step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * step + torch.distributed.get_rank())
    return torch.randint(0, 64, (2, 8), generator=g)


def _chunked_step(m: Lm, tokens: torch.Tensor, toggle: bool) -> list[float]:
    """The chunked loss: the body's output detached, the head run on its own
    per chunk (its backward too), then the body's backward from the chunks'
    input gradients."""
    h = m(tokens, skip_head=True)
    if toggle:
        m.head.set_reshard_after_forward(False)
        m.head.set_reshard_after_backward(False)
    losses, grads = [], []
    for chunk in torch.chunk(h.detach(), 4, dim=1):
        chunk = chunk.contiguous().requires_grad_(True)
        loss = m.head(chunk).logsumexp(-1).sum()
        loss.backward()
        losses.append(loss.item())
        grads.append(chunk.grad)
    if toggle:
        m.head.set_reshard_after_forward(True)
        m.head.set_reshard_after_backward(True)
        m.head.reshard()
    h.backward(torch.cat(grads, dim=1))
    return losses


@pytest.mark.parametrize("toggle", [False, True], ids=["plain", "kept-gathered-per-chunk"])
@needs_torch(2, 13, "list group whose member runs on its own (2.11 leaves the head's weight sharded)")
@multi_rank(world_sizes=(2,))
def test_chunked_loss_with_the_head_run_on_its_own(toggle):
    """Before: the head's gradients were never installed (None), and with
    resharding toggled per chunk a rank died in backward (SIGSEGV)."""
    a, b = _both_lm()
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (a, b)]
    for step in range(3):
        la, lb = (_chunked_step(m, _tokens(step), toggle) for m in (a, b))
        assert la == lb, (step, la, lb)
        _assert_grads_equal(a, b)
        assert a.head.weight.grad is not None
        for o in opts:
            o.step()
            o.zero_grad()
    _assert_params_equal(a, b)


@multi_rank(world_sizes=(2,))
def test_two_partial_forwards_then_one_backward():
    """Before: the group resharded at the root's post-forward without a
    pre-backward hook, and backward read a freed parameter (SIGSEGV)."""
    a, b = _both_lm()
    for step in range(2):
        for m in (a, b):
            h1, h2 = m(_tokens(step), skip_head=True), m(_tokens(step + 7), skip_head=True)
            (h1.square().sum() + h2.sum()).backward()
        _assert_grads_equal(a, b)
        assert a.head.weight.grad is None and a.norm.weight.grad is not None
        for m in (a, b):
            m.zero_grad()


class WithUnused(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.unused = nn.Linear(1, 1)
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.lin(x))


@multi_rank(world_sizes=(2,))
def test_a_member_that_never_runs():
    torch.manual_seed(0)
    a = nn.Sequential(WithUnused(), WithUnused(), nn.Linear(8, 3))
    b = copy.deepcopy(a)
    for fs, m in ((_sw(), a), (_pt(), b)):
        for sub in m[:2]:
            fs([sub.unused, sub.lin])
        fs(m)
    for step in range(3):
        for m in (a, b):
            m(_x(step)).sum().backward()
        _assert_grads_equal(a, b)
        for m in (a, b):
            m.zero_grad()


class Stack(nn.Module):
    def __init__(self, ac: bool) -> None:
        super().__init__()
        self.ac = ac
        self.layers = nn.ModuleList(nn.Sequential(nn.LayerNorm(8), nn.Linear(8, 8), nn.GELU()) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = checkpoint(layer, x, use_reentrant=False) if self.ac else layer(x)
        return x


@pytest.mark.parametrize("ac", [False, True], ids=["eager", "checkpointed"])
@multi_rank(world_sizes=(2,))
def test_two_layers_in_one_group_train_for_several_steps(ac):
    """Before, with activation checkpointing: the recompute left the group
    waiting for a member, and the next step's forward ran on sharded
    parameters ("mixed torch.Tensor and DTensor")."""
    torch.manual_seed(0)
    a = Stack(ac)
    b = copy.deepcopy(a)
    for fs, m in ((_sw(), a), (_pt(), b)):
        fs(m.layers[0])
        fs([m.layers[1], m.layers[2]])
        fs(m)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (a, b)]
    for step in range(3):
        outs = [m(_x(step)) for m in (a, b)]
        torch.testing.assert_close(outs[0], outs[1])
        for out in outs:
            out.square().sum().backward()
        _assert_grads_equal(a, b)
        for o in opts:
            o.step()
            o.zero_grad()
    _assert_params_equal(a, b)


class CastPair(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8, bias=False)
        self.b = nn.Linear(8, 8, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x).float())


@needs_torch(2, 13, "input casts for every member of a list group (2.11 casts the first only)")
@multi_rank(world_sizes=(2,))
def test_inputs_are_cast_for_every_member():
    """Before: only the first member's inputs were cast to param_dtype, so the
    second one failed on a float32 input against bfloat16 weights."""
    torch.manual_seed(0)
    a = CastPair()
    b = copy.deepcopy(a)
    for fs, mp, m in zip((_sw(), _pt()), _mp(param_dtype=torch.bfloat16), (a, b)):
        fs([m.a, m.b], mp_policy=mp)
        fs(m, mp_policy=mp)
    for step in range(2):
        outs = [m(_x(step)) for m in (a, b)]
        assert outs[0].dtype == outs[1].dtype == torch.bfloat16
        torch.testing.assert_close(outs[0], outs[1])
        for out in outs:
            out.float().sum().backward()
        _assert_grads_equal(a, b)
