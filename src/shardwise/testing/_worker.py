"""The worker side of the harness: one process per rank (forked from the fork
server, see harness) that joins the gloo group and serves tasks until told to
stop (or its parent dies)."""

from __future__ import annotations

import ast
import faulthandler
import gc
import importlib
import importlib.util
import multiprocessing
import multiprocessing.connection
import os
import pickle
import signal
import sys
import threading
import traceback
from datetime import timedelta
from pathlib import Path
from types import CodeType, ModuleType, TracebackType
from typing import Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import TCPStore

from shardwise.train.ranks import loopback_interface

_OK = "ok"
_ERROR = "error"
_SKIP = "skip"
_XFAIL = "xfail"
_DIED = "died"

_HOST = "127.0.0.1"
_RANK_FN_PREFIX = "_rank_fn__"
#: Seconds a new pool may take to start and join its process group.
STARTUP_TIMEOUT_S: float = 120.0

def _trim_stack_dump(text: str) -> str:
    """Drop the harness's own frames and threads from a faulthandler dump."""
    here = os.path.basename(__file__)
    blocks = []
    for block in text.strip().split("\n\n"):
        lines = block.splitlines()
        if any(here in line and line.endswith(" in watch") for line in lines):
            continue  # the parent-watchdog thread
        for i, line in enumerate(lines):
            if here in line and line.endswith(" in _run_task"):
                lines = lines[:i]
                break
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks)


# --------------------------------------------------------------------------

# Kept referenced: faulthandler writes to it when the parent sends SIGUSR1,
# and when the worker dies of a fatal signal (SIGSEGV, SIGABRT, ...).
_stack_dump_file: Any = None


def _worker_main(
    rank: int,
    world_size: int,
    store_port: int,
    conn: multiprocessing.connection.Connection,
    dump_path: str,
) -> None:
    """Entry point of a worker: join the group, then serve tasks until told."""
    global _stack_dump_file
    # Ctrl-C reaches the whole process group; the parent handles it.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _exit_with_parent(dump_path)
    _stack_dump_file = open(dump_path, "w")
    faulthandler.enable(file=_stack_dump_file, all_threads=True)
    if hasattr(signal, "SIGUSR1"):
        faulthandler.register(signal.SIGUSR1, file=_stack_dump_file, all_threads=True)
    try:
        os.environ.update(
            OMP_NUM_THREADS="1",
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE=str(world_size),
            LOCAL_WORLD_SIZE=str(world_size),
            MASTER_ADDR=_HOST,
            MASTER_PORT=str(store_port),
        )
        loopback = loopback_interface()
        if loopback is not None:
            os.environ.setdefault("GLOO_SOCKET_IFNAME", loopback)
        torch.set_num_threads(1)
        try:
            torch.set_num_interop_threads(1)
        except RuntimeError:
            pass
        store = TCPStore(
            _HOST,
            store_port,
            None,
            False,
            timeout=timedelta(seconds=STARTUP_TIMEOUT_S),
        )
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
        dist.barrier()
    except BaseException:
        conn.send_bytes(pickle.dumps(("startup-error", traceback.format_exc())))
        return
    conn.send_bytes(pickle.dumps(("ready", os.getpid())))
    # What the imports made lives as long as the process: out of the garbage
    # collector's sight, so that the pass after a task (_release_process_groups)
    # looks only at what tasks made.
    gc.freeze()

    while True:
        try:
            message = pickle.loads(conn.recv_bytes())
        except EOFError:
            break
        if message[0] != "task":
            break
        _, seq, module_name, file_path, qualname, rewrite, kwargs_bytes = message
        status, payload = _run_task(module_name, file_path, qualname, rewrite, kwargs_bytes)
        _flush_stdio()
        try:
            payload_bytes = (
                pickle.dumps(payload, protocol=pickle.HIGHEST_PROTOCOL)
                if status == _OK
                else payload
            )
        except Exception:
            status = _ERROR
            payload_bytes = (
                f"the return value of {qualname.removeprefix(_RANK_FN_PREFIX)} on rank "
                f"{rank} is not picklable:\n"
                + traceback.format_exc()
            )
        conn.send_bytes(
            pickle.dumps(("result", seq, status, payload_bytes), protocol=pickle.HIGHEST_PROTOCOL)
        )
        if status in (_OK, _SKIP, _XFAIL):
            try:
                dist.barrier()
            except Exception:
                # A peer is gone; the parent will replace this pool.
                os._exit(1)
            # Every rank is past the task: no collective of it runs on another group any more.
            _release_process_groups()

    try:
        dist.destroy_process_group()
    except Exception:
        pass
    if "coverage" not in sys.modules:
        # Skip torch's slow interpreter teardown (about a second per worker).
        # With coverage measuring, return so it can save its data.
        _flush_stdio()
        os._exit(0)


def _release_process_groups() -> None:
    """Destroy the process groups that tasks left behind (every group but the
    default one) and what holds on to them, so that their gloo threads end.

    An idle gloo group's transport loop wakes 100 times a second (``epoll_wait``
    with a 10 ms timeout). Tests create groups (``new_group``, each
    ``init_device_mesh`` of two or more dimensions) and never destroy them; left
    alone they add up over a session to some 200 per worker, which then burn a
    third of a core per idle worker. A background checkpoint save still in
    flight keeps them until a later task.
    """
    from torch.distributed import distributed_c10d as c10d

    world = c10d.GroupMember.WORLD
    groups = [pg for pg in c10d._world.pg_map if pg is not world]
    if not groups:
        return
    background = sys.modules.get("shardwise.checkpoint.background")
    pending = getattr(background, "_PENDING", None)
    if pending is not None and not pending.done():
        return
    try:
        _forget_cached_groups()
    except (AttributeError, ImportError):
        # A cache not where this expects it (another torch): keep the groups
        # rather than let it hand a destroyed one to a later task.
        return
    for pg in groups:
        try:
            dist.destroy_process_group(pg)
        except Exception:
            pass
    del groups, pg
    # The task's models and meshes hold the groups, often in reference cycles.
    gc.collect()


def _forget_cached_groups() -> None:
    """Drop what would keep a destroyed group alive or hand it to a later task:
    shardwise's groups and meshes kept per default group (made anew on the next
    use, on every rank alike); DTensor's sharding propagation and redistribution
    caches, whose answers for a mesh equal to an earlier one hold that mesh (and
    so the names of its destroyed groups). (A background save's group needs
    nothing: it is remade once unregistered.)"""
    mesh = sys.modules.get("shardwise.mesh")
    if mesh is not None:
        mesh._SUBGROUPS.clear()
        mesh._SELF_GROUPS.clear()
    strategies = sys.modules.get("shardwise.compat.strategies")
    if strategies is not None:
        strategies._MESHES.clear()
        strategies._SINGLETONS.clear()
    if "torch.distributed.tensor" in sys.modules:
        debug = importlib.import_module("torch.distributed.tensor.debug")
        debug._clear_sharding_prop_cache()
        sharding_prop = importlib.import_module("torch.distributed.tensor._sharding_prop")
        sharding_prop.ShardingPropagator._propagate_tensor_meta_cached.cache_clear()
        redistribute = importlib.import_module("torch.distributed.tensor._redistribute")
        redistribute.clear_redistribute_planner_cache()
        redistribute._gen_transform_infos.cache_clear()
        collective_utils = importlib.import_module("torch.distributed.tensor._collective_utils")
        collective_utils.MeshTopoInfo.build_from_mesh.cache_clear()


def _flush_stdio() -> None:
    """Flush stdout and stderr, so a rank's prints reach the current test."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass


def _run_task(
    module_name: str,
    file_path: str | None,
    qualname: str,
    rewrite: bool,
    kwargs_bytes: bytes,
) -> tuple[str, Any]:
    """Import, resolve and call the task's function; classify the outcome."""
    torch.set_num_threads(1)
    torch.set_grad_enabled(True)
    torch.set_default_dtype(torch.float32)
    try:
        module = _load_module(module_name, file_path, rewrite)
        fn = getattr(module, qualname)
        kwargs = pickle.loads(kwargs_bytes)
        return (_OK, fn(**kwargs))
    except BaseException as exc:
        return _classify(exc)


def _classify(exc: BaseException) -> tuple[str, str]:
    """Map an exception to (status, text): a pytest outcome or a traceback."""
    outcomes = sys.modules.get("_pytest.outcomes")
    if outcomes is not None:
        if isinstance(exc, outcomes.Skipped):
            return (_SKIP, exc.msg or "skipped")
        if isinstance(exc, outcomes.XFailed):
            return (_XFAIL, exc.msg or "xfailed")
    tb: TracebackType | None = exc.__traceback__
    # Drop the harness's own frame (_run_task) from the report.
    if tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return (_ERROR, "".join(traceback.format_exception(type(exc), exc, tb)))


def _load_module(module_name: str, file_path: str | None, rewrite: bool) -> ModuleType:
    """Import the task's module as the pytest process knows it.

    A module already in ``sys.modules`` is used if it comes from
    ``file_path``; otherwise the module is imported by name, and if that fails
    (or finds another file) it is loaded from ``file_path`` and registered in
    ``sys.modules`` under ``module_name``. Modules that pytest rewrote for
    assertion introspection are loaded from their file with the same rewrite.
    """
    module = sys.modules.get(module_name)
    if module is not None and _same_file(getattr(module, "__file__", None), file_path):
        return module
    if module is None and not (rewrite and file_path is not None):
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            module = None
        if module is not None and _same_file(getattr(module, "__file__", None), file_path):
            return module
    if file_path is None:
        raise ImportError(f"cannot import {module_name!r} and it has no file to load")
    return _load_from_file(module_name, file_path, rewrite)


def _same_file(actual: str | None, expected: str | None) -> bool:
    """Whether a module's ``__file__`` is the expected file (None: unknown)."""
    if expected is None:
        return True
    if actual is None:
        return False
    return os.path.realpath(actual) == os.path.realpath(expected)


def _load_from_file(module_name: str, file_path: str, rewrite: bool) -> ModuleType:
    """Execute ``file_path`` as module ``module_name`` and register it."""
    spec = importlib.util.spec_from_file_location(module_name, file_path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {module_name!r} from {file_path}")
    module = importlib.util.module_from_spec(spec)
    previous = sys.modules.get(module_name)
    sys.modules[module_name] = module
    try:
        code = _rewritten_code(file_path) if rewrite else None
        if code is not None:
            exec(code, module.__dict__)
        else:
            spec.loader.exec_module(module)
    except BaseException:
        if previous is None:
            sys.modules.pop(module_name, None)
        else:
            sys.modules[module_name] = previous
        raise
    return module


def _rewritten_code(file_path: str) -> CodeType | None:
    """Compile ``file_path`` with pytest's assertion rewriting, if available."""
    try:
        from _pytest.assertion.rewrite import rewrite_asserts
    except ImportError:
        return None
    source = Path(file_path).read_bytes()
    tree = ast.parse(source, filename=file_path)
    rewrite_asserts(tree, source, file_path, None)
    return compile(tree, file_path, "exec", dont_inherit=True)


def _exit_with_parent(dump_path: str) -> None:
    """Exit this worker (removing its stack-dump file) once the parent is gone."""
    parent = multiprocessing.parent_process()
    if parent is None:
        return
    sentinel = parent.sentinel

    def watch() -> None:
        multiprocessing.connection.wait([sentinel])
        try:
            os.unlink(dump_path)
        except OSError:
            pass
        os._exit(1)

    threading.Thread(target=watch, name="shardwise-parent-watchdog", daemon=True).start()
