"""The three walks over a forward's containers ([Note: walking forward
containers] in shardwise/_engine/trees.py), each against PyTorch's own
``_apply_to_tensors`` where PyTorch has one."""

from __future__ import annotations

import collections
import dataclasses

import pytest
import torch
from torch.distributed.utils import _apply_to_tensors
from torch.nn.utils.rnn import pack_sequence

from shardwise._engine.trees import cast_floats, grad_tensors, map_tensors, replace_grad_tensors


@dataclasses.dataclass
class _Counted:
    x: torch.Tensor
    runs: int = 0

    def __post_init__(self):
        self.runs += 1


class _Tagged(dict):
    pass


def _bf16(t):
    return t.to(torch.bfloat16) if t.is_floating_point() else t


def test_the_cast_walk_rebuilds_as_pytorchs():
    x = torch.randn(2)
    tree = (
        _Tagged(a=x),
        collections.OrderedDict(b=x),
        {x},
        _Counted(x),
        collections.defaultdict(list, c=x),
        [x, (x, 3)],
    )
    ours, theirs = cast_floats(tree, torch.bfloat16), _apply_to_tensors(_bf16, tree)
    assert [type(a) for a in ours] == [type(b) for b in theirs] == [dict, collections.OrderedDict, set, _Counted, dict, list]
    assert ours[3].runs == theirs[3].runs == 3  # made once, rebuilt twice
    assert next(iter(ours[2])).dtype == torch.bfloat16
    assert ours[5][1][0].dtype == torch.bfloat16 and ours[5][1][1] == 3


def test_a_packed_sequence_is_cast_and_kept_when_unchanged():
    ps = pack_sequence([torch.randn(3, 2), torch.randn(2, 2)])
    assert map_tensors(lambda t: t, ps) is ps  # as PyTorch returns it
    cast = cast_floats(ps, torch.bfloat16)
    assert cast.data.dtype == torch.bfloat16 and torch.equal(cast.batch_sizes, ps.batch_sizes)


def test_an_init_false_field_under_the_cast_is_refused_as_pytorch():
    @dataclasses.dataclass
    class Cached:
        x: torch.Tensor
        cache: int = dataclasses.field(default=0, init=False)

    with pytest.raises(ValueError, match="init=False"):
        cast_floats(Cached(torch.randn(2)), torch.bfloat16)
    with pytest.raises(ValueError, match="init=False"):
        _apply_to_tensors(_bf16, Cached(torch.randn(2)))
    assert cast_floats(_Counted, torch.bfloat16) is _Counted  # a class is left alone


def test_finding_and_replacing_grad_tensors_rebuild_only_what_changed():
    a, b = torch.randn(2, requires_grad=True), torch.randn(2)
    d = collections.defaultdict(list, a=a, b=b)
    counted = _Counted(a)
    tree = ({a}, d, counted, (b,), [a])
    assert grad_tensors(tree) == [a, a, a]  # a set is not opened
    assert len(grad_tensors(tree, in_sets=True)) == 4
    new = [t.view_as(t) for t in grad_tensors(tree)]
    out = replace_grad_tensors(tree, iter(new))
    assert out[0] is tree[0] and out[3] is tree[3]  # nothing inside changed
    assert type(out[1]) is collections.defaultdict and out[1]["a"] is new[0] and out[1]["b"] is b
    assert out[1].default_factory is list and d["a"] is a  # a copy, the caller's untouched
    assert out[2].x is new[1] and out[2].runs == 2 and counted.runs == 1
    assert out[4][0] is new[2]


def test_a_container_that_holds_itself_is_an_error():
    loop: list = []
    loop.append(loop)
    with pytest.raises(RuntimeError, match="max depth"):
        grad_tensors(loop)
