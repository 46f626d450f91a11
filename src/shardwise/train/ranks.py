"""How ``shardwise train`` starts its local ranks: the environment every rank
inherits, and the fork server every rank is forked from.

The server imports the rank's code, and so torch, once (seconds on a small
machine). The command starts it as soon as its flags are checked, before it
imports torch itself, so the two imports run at once rather than one after
the other. That is why this module, the flags (``config``) and the package
``__init__`` files import no torch.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import socket
from collections.abc import Mapping

__all__ = ["loopback_interface", "rank_environment", "start_method", "start_server", "stop_server", "under_torchrun"]

_RANK_CODE = "shardwise.train.loop"  # what the server imports before forking any rank


def under_torchrun(env: Mapping[str, str] | None = None) -> bool:
    """Whether this process is one rank of a ``torchrun`` launch (``RANK`` and ``WORLD_SIZE`` set)."""
    env = os.environ if env is None else env
    return "RANK" in env and "WORLD_SIZE" in env


def loopback_interface() -> str | None:
    """The loopback network interface's name (``lo``, ``lo0``), if any."""
    try:
        names = [name for _, name in socket.if_nameindex()]
    except (OSError, AttributeError):  # pragma: no cover - platforms without if_nameindex
        return None
    return next((n for n in names if n.startswith("lo")), None)


def rank_environment(nproc: int) -> None:
    """Set what ``nproc`` local ranks inherit, where the user has not: an equal
    share of the cores as intra-op threads each (one each on a small machine),
    and gloo's sockets on the loopback interface (local ranks meet at 127.0.0.1)."""
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    loopback = loopback_interface()
    if loopback is not None:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", loopback)


def start_method() -> str:
    """``forkserver`` where there is one, its server importing the rank's code
    once and then forking every rank from it: each rank starts without
    importing torch anew, and inherits nothing this process has run, as with
    ``spawn`` (the fallback)."""
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return "spawn"
    multiprocessing.get_context("forkserver").set_forkserver_preload([_RANK_CODE])
    return "forkserver"


def start_server(nproc: int) -> bool:
    """Start the fork server for ``nproc`` local ranks now, and say whether
    this call started it (not where one runs already, or where there is none).
    A server keeps the environment of the moment it starts, so
    :func:`rank_environment` is set first."""
    rank_environment(nproc)
    if start_method() != "forkserver":
        return False
    from multiprocessing import forkserver

    server = forkserver._forkserver
    before = getattr(server, "_forkserver_pid", None)
    forkserver.ensure_running()  # (re)starts it unless it runs
    return getattr(server, "_forkserver_pid", None) != before


def stop_server() -> None:
    """Stop the fork server that :func:`start_server` started (it returned
    ``True``) for a command that failed, a check refusing the run, say: no
    server is left importing torch for nothing after the command has exited.
    (After a run, the server stays for the next launch of this process, as
    ever.)"""
    from multiprocessing import forkserver

    server = forkserver._forkserver
    pid = getattr(server, "_forkserver_pid", None)
    if pid is None:
        return
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:  # pragma: no cover - already gone
        pass
    getattr(server, "_stop", lambda: None)()  # reaps it and forgets it, so a later launch starts afresh
