"""The public surface is exact, imports flow one way, and the library never
leans on PyTorch's own FSDP."""

from __future__ import annotations

import ast
import inspect
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from fsdp_reference import TORCH_VERSION as _TORCH_VERSION

import shardwise

SRC = Path(shardwise.__file__).parent

# bottom -> top; a module may import only from its own layer or those below.
LAYERS = {
    "shardwise.policies": 0,
    "shardwise.errors": 0,
    "shardwise.comm": 0,
    "shardwise.shared_rows": 0,  # shared-memory exchanges, under comm
    "shardwise.compression": 0,
    "shardwise.mesh": 1,
    "shardwise._engine": 2,
    "shardwise.fully_shard": 3,
    "shardwise.wrap": 4,  # wrap policies + apply_policy, above fully_shard
    "shardwise.compat": 5,  # the wrapper API, above fully_shard and wrap
    "shardwise.api": 5,  # torch.distributed.fsdp.api's names, from compat
    "shardwise.fully_sharded_data_parallel": 5,  # and that module's
    "shardwise.models": 0,
    "shardwise.layout": 0,  # chunk arithmetic, used by every layer
    "shardwise._lazy": 0,  # the packages' names loaded on first use
    "shardwise.planner": 0,  # depends on policies, layout and observe alone
    "shardwise.observe": 0,  # what the engine tells observers (the planner's tracker)
    "shardwise.watchdog": 1,  # over observe and errors: the engine's regions are its progress events
    "shardwise.checkpoint": 4,  # state dicts over the engine, beside wrap
    "shardwise.testing": 9,
    "shardwise.train": 8,  # the main job, over everything but testing
    "shardwise.cli": 9,
    "shardwise.__main__": 9,
    "shardwise": 6,  # the package __init__
}


def _layer(module: str) -> int:
    best = ""
    for name in LAYERS:
        if (module == name or module.startswith(name + ".")) and len(name) > len(best):
            best = name
    return LAYERS[best]


def _modules() -> list[tuple[str, Path]]:
    out = []
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC.parent).with_suffix("")
        name = ".".join(rel.parts).removesuffix(".__init__")
        out.append((name, path))
    return out


def _imports(path: Path, package: str) -> list[str]:
    tree = ast.parse(path.read_text())
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                names.append(".".join(base + ([node.module] if node.module else [])))
            elif node.module:
                names.append(node.module)
    return names


def test_public_names_are_exact():
    assert sorted(shardwise.__all__) == sorted(
        [
            "AllGather",
            "BackwardPrefetch",
            "CPUOffload",
            "CPUOffloadPolicy",
            "Comm",
            "DataParallelMeshDims",
            "FSDPModule",
            "FullOptimStateDictConfig",
            "FullStateDictConfig",
            "FullyShardedDataParallel",
            "LocalOptimStateDictConfig",
            "LocalStateDictConfig",
            "MixedPrecision",
            "MixedPrecisionPolicy",
            "OffloadPolicy",
            "OptimStateDictConfig",
            "OptimStateKeyType",
            "QuantizedAllGather",
            "ReduceScatter",
            "ShardedOptimStateDictConfig",
            "ShardedStateDictConfig",
            "ShardingStrategy",
            "StateDictConfig",
            "StateDictSettings",
            "StateDictType",
            "UnshardHandle",
            "apply_policy",
            "fully_shard",
            "register_fsdp_forward_method",
            "share_comm_ctx",
            "summon_full_params",
        ]
    )
    for name in shardwise.__all__:
        assert getattr(shardwise, name) is not None


def _python(code: str) -> str:
    """Run ``code`` in a fresh interpreter (nothing imported yet) and return its output."""
    env = {**os.environ, "PYTHONPATH": str(SRC.parent) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def test_public_names_load_on_first_use():
    import shardwise.train

    # every public name has a home, and nothing else is offered
    for package in (shardwise, shardwise.train):
        assert set(package.__all__) == set(package._exports)
        for name in package.__all__:
            assert name in dir(package)
    # The function, never the submodule of the same name, however the package was
    # reached first: through another name whose module imports shardwise.fully_shard,
    # through the submodule itself, or by star import.
    out = _python(
        "import types\n"
        "from shardwise import FullyShardedDataParallel\n"
        "import shardwise, shardwise.fully_shard, shardwise.train.launch\n"
        "from shardwise import fully_shard\n"
        "from shardwise import *\n"
        "from shardwise import checkpoint\n"
        "import shardwise.train as train\n"
        "print(type(fully_shard).__name__, type(shardwise.fully_shard).__name__, FSDPModule.__name__,\n"
        "      checkpoint.__name__, train.launch.__module__)\n"
    )
    assert out.split() == ["function", "function", "FSDPModule", "shardwise.checkpoint", "shardwise.train.loop"]


def test_the_command_checks_its_settings_without_torch():
    """``shardwise train`` starts its ranks' fork server before it imports torch
    (``shardwise.train.ranks``): parsing and checking the settings must not import it."""
    out = _python(
        "import sys\n"
        "import shardwise, shardwise.train\n"
        "from shardwise.cli import _parser, _train_config\n"
        "ns, _ = _parser().parse_known_args(['train', '--steps', '3', '--watchdog-timeout', '30'])\n"
        "print(_train_config(ns).steps, sorted(m for m in sys.modules if m.split('.')[0] == 'torch'))\n"
    )
    assert out.split() == ["3", "[]"]


def test_a_fork_server_started_early_is_stopped_when_the_launch_is_refused():
    out = _python(
        "import os\n"
        "from multiprocessing import forkserver\n"
        "from shardwise.train.ranks import start_server, stop_server\n"
        "assert start_server(2) is True\n"
        "pid = forkserver._forkserver._forkserver_pid\n"
        "assert start_server(2) is False  # running already: not this call's to stop\n"
        "stop_server()\n"
        "try:\n"
        "    os.kill(pid, 0)\n"
        "except ProcessLookupError:\n"
        "    print('gone')\n"
    )
    assert out.split() == ["gone"]


@pytest.mark.parametrize("name,path", _modules(), ids=lambda v: str(v))
def test_imports_flow_one_way(name, path):
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    own = _layer(name)
    for imported in _imports(path, package):
        if not imported.startswith("shardwise"):
            assert not imported.startswith(("torch.distributed.fsdp", "torch.distributed._composable")), (
                f"{name} imports {imported}: the engine is ours"
            )
            continue
        if name.startswith("shardwise.testing") or name.startswith("shardwise.cli"):
            continue
        assert not imported.startswith("shardwise.testing"), f"{name} imports the test harness"
        assert _layer(imported) <= own, f"{name} (layer {own}) imports {imported} (layer {_layer(imported)})"


def test_no_import_cycles():
    """No two library modules reach each other by imports, counting every
    import: function-level (lazy) and ``TYPE_CHECKING`` ones too. ``from
    pkg import sub`` counts as importing the submodule ``pkg.sub``."""
    mods = dict(_modules())
    edges: dict[str, set[str]] = {}
    for name, path in mods.items():
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")
                    stem = ".".join(base[: len(base) - node.level + 1] + ([node.module] if node.module else []))
                else:
                    stem = node.module or ""
                found = [f"{stem}.{a.name}" if f"{stem}.{a.name}" in mods else stem for a in node.names]
            elif isinstance(node, ast.Import):
                found = [a.name for a in node.names]
            else:
                continue
            for t in found:
                while t and t not in mods:
                    t = t.rpartition(".")[0]
                if t and t != name and t != "shardwise" and t.startswith("shardwise"):
                    targets.add(t)
        edges[name] = targets

    def reach(start: str) -> set[str]:
        seen: set[str] = set()
        todo = [start]
        while todo:
            for nxt in edges[todo.pop()]:
                if nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
        return seen

    reached = {m: reach(m) for m in mods}
    cycles = sorted({tuple(sorted((a, b))) for a in mods for b in edges[a] if a in reached[b]})
    assert not cycles, f"import cycles: {cycles}"


def test_engine_never_imports_the_fronts():
    """The wrapper API sits on the engine; the engine knows nothing of it."""
    for name, path in _modules():
        if not any(name == m or name.startswith(m + ".") for m in ("shardwise._engine", "shardwise.fully_shard",
                                                                   "shardwise.mesh")):
            continue
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        for imported in _imports(path, package):
            assert not imported.startswith(("shardwise.compat", "shardwise.wrap")), f"{name} imports {imported}"


def test_no_bare_assert_in_library():
    for name, path in _modules():
        if name.startswith("shardwise.testing"):
            continue
        tree = ast.parse(path.read_text())
        asserts = [n.lineno for n in ast.walk(tree) if isinstance(n, ast.Assert)]
        assert not asserts, f"{path}:{asserts}: raise AssertionError(...) instead (asserts vanish under -O)"


def test_modules_stay_small():
    for _, path in _modules():
        n = len(path.read_text().splitlines())
        assert n <= 1000, f"{path} has {n} lines; split it by concept"


def test_fsdp_module_methods_match_pytorch_signatures():
    from torch.distributed.fsdp import FSDPModule as TorchFSDPModule

    from shardwise import FSDPModule

    for name in [
        "reshard", "unshard", "set_requires_gradient_sync", "set_requires_all_reduce",
        "set_reshard_after_forward", "set_reshard_after_backward", "set_is_last_backward",
        "set_modules_to_forward_prefetch", "set_modules_to_backward_prefetch",
        "set_reduce_scatter_divide_factor", "set_gradient_divide_factor", "set_unshard_in_backward",
        "set_all_reduce_hook", "set_post_optim_event", "set_custom_all_gather",
        "set_custom_reduce_scatter", "reset_iter_state", "set_reduce_scatter_unused_params",
        "set_reduce_scatter_max_input_buffers", "set_separate_reduce_scatter_group",
        "set_allocate_memory_from_process_group_for_comm", "set_symm_mem_for_comm",
        "set_force_sum_reduction_for_comms",
    ]:
        if not hasattr(TorchFSDPModule, name) and _TORCH_VERSION < (2, 13):
            continue  # added to PyTorch's FSDPModule after this torch (all are there in 2.13)
        ours = inspect.signature(getattr(FSDPModule, name))
        theirs = inspect.signature(getattr(TorchFSDPModule, name))
        assert list(ours.parameters) == list(theirs.parameters), name
        for p in ours.parameters.values():
            assert p.kind == theirs.parameters[p.name].kind, (name, p.name)
            assert p.default == theirs.parameters[p.name].default, (name, p.name)


def test_fully_shard_signature_matches_pytorch():
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    ours = inspect.signature(shardwise.fully_shard).parameters
    theirs = inspect.signature(torch_fully_shard).parameters
    for name, p in ours.items():
        if name == "dp_mesh_dims" and _TORCH_VERSION < (2, 13):
            continue  # new in PyTorch 2.13
        assert name in theirs and p.kind == theirs[name].kind, name
        if name != "mp_policy" and name != "offload_policy":
            assert p.default == theirs[name].default, name


def test_policies_are_frozen_and_validated():
    from dataclasses import FrozenInstanceError

    from shardwise import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy

    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    with pytest.raises(FrozenInstanceError):
        mp.param_dtype = torch.float16  # type: ignore[misc]
    assert MixedPrecisionPolicy().cast_forward_inputs is True
    assert isinstance(CPUOffloadPolicy(), OffloadPolicy) and CPUOffloadPolicy().pin_memory is True
    with pytest.raises(TypeError, match="pin_memory must be a bool"):
        CPUOffloadPolicy(pin_memory="yes")  # type: ignore[arg-type]


def test_shard_layout_matches_torch_chunk():
    from shardwise.layout import ShardLayout

    for dim_size in range(0, 11):
        for ws in (1, 2, 3, 4, 7):
            full = torch.arange(dim_size * 3, dtype=torch.float32).reshape(dim_size, 3)
            chunks = torch.chunk(full, ws, dim=0) if dim_size else ()
            layouts = [ShardLayout.make(full.shape, 0, ws, r) for r in range(ws)]
            gathered = torch.full((ws, *layouts[0].padded_shape), float("nan"))
            for r, layout in enumerate(layouts):
                expected = chunks[r] if r < len(chunks) else full[:0]
                assert torch.equal(layout.local_chunk(full), expected), (dim_size, ws, r)
                gathered[r, : layout.local_rows] = layout.local_chunk(full)
            out = torch.empty_like(full)
            layouts[0].gather_into(out, gathered)
            assert torch.equal(out, full)
            scattered = torch.full_like(gathered, float("nan"))
            layouts[0].scatter_from(full, scattered)
            assert not scattered.isnan().any()
            for r, layout in enumerate(layouts):
                assert torch.equal(scattered[r, : layout.local_rows], layout.local_chunk(full))


def test_shard_layout_other_dim():
    from shardwise.layout import ShardLayout

    full = torch.randn(4, 7, 3)
    ws = 3
    layouts = [ShardLayout.make(full.shape, 1, ws, r) for r in range(ws)]
    buf = torch.zeros(ws, *layouts[0].padded_shape)
    layouts[0].scatter_from(full, buf)
    for r, chunk in enumerate(torch.chunk(full, ws, dim=1)):
        assert torch.equal(buf[r].narrow(1, 0, chunk.shape[1]), chunk)
    out = torch.empty_like(full)
    layouts[0].gather_into(out, buf)
    assert torch.equal(out, full)


@pytest.mark.parametrize("dim", [0, 1])
def test_flat_layout_local_views_are_each_ranks_chunk(dim):
    """A reduce-scatter's output (each tensor's padded shard back to back) cut
    into this rank's unpadded chunks: torch.chunk's pieces, as views of the
    row, for even, uneven, empty and missing chunks."""
    from shardwise.layout import FlatLayout, ShardLayout

    fulls = [torch.randn(5, 3), torch.randn(8, 2), torch.randn(1, 4), torch.randn(0, 3), torch.randn(6, 7, 2)]
    for ws in (1, 2, 3, 4, 7):
        for rank in range(ws):
            layouts = [ShardLayout.make(f.shape, dim, ws, rank) for f in fulls]
            flat = FlatLayout.of(layouts)
            assert flat.dim0 == (dim == 0)
            row = torch.full((flat.total,), float("nan"))
            for f, layout, a, b in zip(fulls, layouts, flat.offsets, flat.offsets[1:]):
                padded = torch.full((ws, *layout.padded_shape), float("nan"))
                layout.scatter_from(f, padded)
                row[a:b] = padded[rank].reshape(-1)
            views = flat.local_views(row)
            assert len(views) == len(fulls)
            for f, view in zip(fulls, views):
                pieces = torch.chunk(f, ws, dim=dim) if f.shape[dim] else ()
                expected = pieces[rank] if rank < len(pieces) else f.narrow(dim, 0, 0)
                assert view.shape == expected.shape and torch.equal(view, expected), (ws, rank, dim)
                if view.numel():
                    assert view.untyped_storage().data_ptr() == row.untyped_storage().data_ptr()


@pytest.mark.parametrize("sub", ["api", "fully_sharded_data_parallel", "wrap"])
def test_torch_fsdp_submodules_have_a_shardwise_twin(sub):
    """Code importing from ``torch.distributed.fsdp.<sub>`` finds the same names
    (and the same ``__all__``) in ``shardwise.<sub>``; the classes are
    shardwise's own (ours for the wrapper and its configuration)."""
    import importlib

    theirs = importlib.import_module(f"torch.distributed.fsdp.{sub}")
    ours = importlib.import_module(f"shardwise.{sub}")
    names = getattr(theirs, "__all__", None)
    if sub == "wrap":  # shardwise.wrap's own __all__ adds apply_policy; PyTorch's public policies must be there
        names = [n for n in dir(theirs) if not n.startswith("_") and (n.endswith("Policy") or n.endswith("_policy"))]
        assert names
    else:
        assert sorted(ours.__all__) == sorted(theirs.__all__)
    for name in names:
        assert hasattr(ours, name), f"shardwise.{sub} lacks {name}"
        assert getattr(ours, name).__module__.startswith("shardwise"), name
    if sub != "wrap":
        import shardwise

        for name in names:
            assert getattr(ours, name) is getattr(shardwise, name), name


def test_wrapper_divides_gradients_around_the_sum_as_fsdp1():
    """FSDP1 divides gradients by its pre-divide factor before the sum and by
    the rest after, in every dtype: the wrapper's split is PyTorch's own rule
    at every world size (it differs from fully_shard's fp16 split at six)."""
    from torch.distributed.algorithms._comm_hooks.default_hooks import DefaultState

    from shardwise._engine.plan import fsdp1_predivide

    for world in range(1, 130):
        assert fsdp1_predivide(float(world)) == DefaultState._get_gradient_predivide_factor(world), world
    assert fsdp1_predivide(6.0) == 4.0
