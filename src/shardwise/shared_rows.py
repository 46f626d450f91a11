"""Ranks of one host exchanging a collective's rows through shared memory.

[Note: shared rows]
Over gloo every byte of an exchange goes through loopback TCP: copied into
the kernel and out again on gloo's threads, on the cores that compute needs
(on this project's 2 cores, 40 ms of the fp32 GPT's 727 ms step at two
ranks). With ``SHARDWISE_SHARED_MEMORY=1`` (off by default while it is new)
a gloo group whose ranks can open each other's memory keeps the large
buffers that its all-gathers gather into and its reduce-scatters reduce
from (at least ``MIN_BYTES``) in anonymous shared memory
(``memfd_create``) that every rank of the group maps, the others through
``/proc/<pid>/fd/<fd>``: each rank writes its rows into its own buffer as
before (the all-gather's copy-in, the reduce-scatter's copy-in of the
gradients); only a descriptor of it goes over gloo (a few int64s: over two
ranks one exchange, over more one gather, held and packed like any small
exchange or gather, so collectives keep gloo's order on every rank); and
each rank reads the others' rows where they lie: the all-gather copies
them into its own buffer, the reduce-scatter sums every rank's row for it
as over gloo (over two ranks its own row plus the other's; over more in
gloo's ring order, ``comm.ring_sum``): the same bits.

A buffer read by other ranks must not be written again before their reads
ended. Every exchange of a buffer carries a sequence number; a reader,
after reading, writes it in its control block (an int64 per buffer of each
other rank, in memory they map), and a buffer given back is handed out
again only once every other rank's control block shows its last exchange
read; else a new buffer is made. (x86-64 alone: there a store is never
seen before the loads that preceded it, so the count is written after the
read.) Buffers stay for the group's life and have no name: nothing is left
behind when a rank dies, and /dev/shm's size does not limit them. Memory
is reserved with ``posix_fallocate`` when made, so a host out of memory is
an error naming the setting, not a SIGBUS later, and the same error on
every rank of the group: a rank that cannot make a buffer takes an
ordinary one and sends, in place of its descriptor, one that says why
(buffer -1, the error number), so every rank raises at that exchange
instead of the others waiting on a peer that left. Whether a group uses this
is settled once, collectively, at its first large buffer: each rank must
open every other rank's control block and find the number that rank wrote
there (one host, one process namespace), else the group stays on gloo.
Only memory made here, of the size expected, is ever mapped (``_open``
checks the descriptor's target first): mapping a shorter file would extend
it, and a process of the same number on another host is someone else's.
"""

from __future__ import annotations

import contextlib
import os
import platform
import secrets
import weakref

import torch
import torch.distributed as dist

ENV = "SHARDWISE_SHARED_MEMORY"
MIN_BYTES = 256 << 10
_MAX_BUFFERS = 4096  # per rank and group: the control block's length
_NAME = "shardwise-rows"  # of every memory made here (the other rank checks it)
_TOO_MANY = -1  # why a buffer was not made shared, in its descriptor, beside errno values (0: not mapped)


def requested() -> bool:
    """Whether ``SHARDWISE_SHARED_MEMORY`` asks for shared-memory exchanges."""
    return os.environ.get(ENV, "0") not in ("", "0")


def _supported() -> bool:
    return platform.system() == "Linux" and platform.machine() in ("x86_64", "AMD64") and hasattr(os, "memfd_create")


def _create(nbytes: int) -> tuple[torch.Tensor, int]:
    """Anonymous shared memory of ``nbytes`` (reserved now), mapped; and its
    file descriptor, by which the other rank opens it. Raises OSError."""
    fd = os.memfd_create(_NAME, os.MFD_CLOEXEC)
    try:
        os.posix_fallocate(fd, 0, nbytes)
        return _map(f"/proc/self/fd/{fd}", nbytes), fd
    except OSError:
        os.close(fd)
        raise
    except RuntimeError as exc:  # torch could not map it
        os.close(fd)
        raise OSError(str(exc)) from exc


def _open(pid: int, fd: int, nbytes: int) -> torch.Tensor | None:
    """The other rank's shared memory, by its process and descriptor; None if
    it cannot be opened (another host, another process namespace). Only
    memory this module made, of the size expected, is mapped: mapping
    extends a shorter file, and the process of that number on another host
    is someone else's."""
    path = f"/proc/{pid}/fd/{fd}"
    try:
        if not os.readlink(path).startswith(f"/memfd:{_NAME} ") or os.stat(path).st_size != nbytes:
            return None
        return _map(path, nbytes)
    except (OSError, RuntimeError):
        return None


def _map(path: str, nbytes: int) -> torch.Tensor:
    with torch.inference_mode(False):  # reused outside inference mode too
        return torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)


def _why(code: int) -> str:
    """What a refused buffer's descriptor says, in words."""
    if code == _TOO_MANY:
        return f"more than {_MAX_BUFFERS} buffers in flight"
    return os.strerror(code) if code > 0 else "its memory could not be mapped"


def _close(fds: list[int]) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)


class SharedRows:
    """One gloo group's shared buffers: this rank's, the other ranks' it
    mapped, and every rank's control block."""

    def __init__(
        self, group: dist.ProcessGroup, pids: list[int], ctrl_mine: torch.Tensor, ctrl_of: dict[int, torch.Tensor],
        fds: list[int],
    ) -> None:
        self.me = group.rank()
        self.pids = pids
        # ctrl_mine[r * _MAX_BUFFERS + j]: the last exchange of rank r's buffer j this rank read;
        # ctrl_of[r]: rank r's block, where it says which of this rank's buffers it read
        self.ctrl_mine, self.ctrl_of = ctrl_mine, ctrl_of
        self.fds = fds  # this rank's descriptors, open while the group lives
        weakref.finalize(self, _close, fds)
        self.mine: list[torch.Tensor] = []
        self.last_use: list[int] = []
        self.free: dict[int, list[int]] = {}
        self.index: dict[int, int] = {}  # data address -> buffer
        self.theirs: dict[tuple[int, int], torch.Tensor] = {}  # (rank, its buffer) -> mapping
        self.refused: dict[int, int] = {}  # data address -> why (errno, 0 or _TOO_MANY) of a buffer not made shared
        self.seq = 0
        self.exchanges = 0  # how many went through shared memory (tests read it)

    def _read(self, i: int) -> bool:
        """Whether every other rank has read buffer i's last exchange."""
        at = self.me * _MAX_BUFFERS + i
        return all(int(ctrl[at]) >= self.last_use[i] for ctrl in self.ctrl_of.values())

    def take(self, nbytes: int) -> torch.Tensor:
        """A buffer of ``nbytes`` that no other rank reads any more."""
        free = self.free.get(nbytes, [])
        for k, i in enumerate(free):
            if self._read(i):
                del free[k]
                return self.mine[i]
        i = len(self.mine)
        why = _TOO_MANY if i >= _MAX_BUFFERS else None
        if why is None:
            try:
                buf, fd = _create(nbytes)
            except OSError as exc:
                why = exc.errno if exc.errno is not None and exc.errno > 0 else 0
        if why is not None:
            # an ordinary buffer, whose exchange tells every rank why ([Note: shared rows])
            buf = torch.empty(nbytes, dtype=torch.uint8)
            self.refused[buf.data_ptr()] = why
            return buf
        self.fds.append(fd)
        self.mine.append(buf)
        self.last_use.append(-1)
        self.index[buf.data_ptr()] = i
        return buf

    def give(self, buf: torch.Tensor) -> bool:
        """Take ``buf`` back if it is one of this group's buffers."""
        address = buf.untyped_storage().data_ptr()
        self.refused.pop(address, None)
        i = self.index.get(address)
        if i is None:
            return False
        self.free.setdefault(self.mine[i].numel(), []).append(i)
        return True

    def describe(self, t: torch.Tensor) -> torch.Tensor | None:
        """If ``t`` lies in one of this rank's buffers (just written for an
        exchange): the descriptor to send the other ranks, [buffer, its file
        descriptor, byte offset, buffer bytes, sequence number]; for one
        that could not be made shared, [-1, why, 0, its bytes, sequence
        number]; else None."""
        address = t.untyped_storage().data_ptr()
        why = self.refused.pop(address, None)
        if why is not None:
            self.seq += 1
            return torch.tensor([-1, why, 0, t.untyped_storage().nbytes(), self.seq])
        i = self.index.get(address)
        if i is None:
            return None
        self.seq += 1
        self.last_use[i] = self.seq
        self.exchanges += 1
        return torch.tensor([i, self.fds[i + 1], t.storage_offset() * t.element_size(), self.mine[i].numel(), self.seq])

    def check(self, every: torch.Tensor) -> list[list[int]]:
        """Every rank's descriptor in ``every``, as ints (what ``read`` and
        ``done`` take); raises, on every rank alike, if any says it could not
        make its buffer shared."""
        descs: list[list[int]] = every.tolist()
        refused = [(rank, desc[1]) for rank, desc in enumerate(descs) if desc[0] < 0]
        if refused:
            why = "; ".join(f"rank {rank}: " + _why(code) for rank, code in refused)
            raise RuntimeError(
                f"{ENV}=1: shared memory for an exchange could not be made on ranks of this group ({why}); "
                f"set {ENV}=0 to exchange over gloo alone"
            )
        return descs

    def read(self, desc: list[int], like: torch.Tensor, rank: int) -> torch.Tensor:
        """Rank ``rank``'s tensor that its ``desc`` describes, shaped as ``like``."""
        i, fd, offset, nbytes, _ = desc
        buf = self.theirs.get((rank, i))
        if buf is None:
            buf = _open(self.pids[rank], fd, nbytes)
            if buf is None:
                raise RuntimeError(f"{ENV}=1: could not open rank {rank}'s buffer {i} (process {self.pids[rank]})")
            self.theirs[(rank, i)] = buf
        n = like.numel() * like.element_size()
        return buf[offset : offset + n].view(like.dtype).view(like.shape)

    def done(self, descs: list[list[int]]) -> None:
        """Every other rank's buffer in ``descs`` (their descriptors, rank-major,
        from ``check``) was read: each may write its buffer again."""
        for rank, desc in enumerate(descs):
            if rank != self.me:
                self.ctrl_mine[rank * _MAX_BUFFERS + desc[0]] = desc[4]


_groups: weakref.WeakKeyDictionary[dist.ProcessGroup, SharedRows | None] = weakref.WeakKeyDictionary()


def existing(group: dist.ProcessGroup) -> SharedRows | None:
    """The group's shared buffers if it has any (no set-up)."""
    return _groups.get(group) if _groups else None


def give(buf: torch.Tensor) -> bool:
    """Take ``buf`` back if it is a shared buffer of any group."""
    if not _groups:  # the usual case: nothing shared anywhere
        return False
    return any(rows is not None and rows.give(buf) for rows in list(_groups.values()))


def for_group(group: dist.ProcessGroup) -> SharedRows | None:
    """The group's shared buffers, set up on first use (a collective over
    ``group``: call it at the same point on every rank); None where the group
    exchanges over gloo alone."""
    if group in _groups:
        return _groups[group]
    rows = _setup(group) if group.size() >= 2 and _supported() else None
    _groups[group] = rows
    return rows


def _setup(group: dist.ProcessGroup) -> SharedRows | None:
    me, size = group.rank(), group.size()
    ctrl_bytes = 8 * (size * _MAX_BUFFERS + 1)
    ok = 1
    nonce = secrets.randbits(62)
    fds: list[int] = []
    try:
        ctrl, fd = _create(ctrl_bytes)
        fds.append(fd)
        ctrl_mine = ctrl.view(torch.int64)
        ctrl_mine.fill_(-1)
        ctrl_mine[-1] = nonce  # proves to the other ranks that they opened this one
    except (OSError, RuntimeError):
        ok, fd, ctrl_mine = 0, -1, torch.empty(0, dtype=torch.int64)
    every = torch.zeros(size, 4, dtype=torch.int64)
    every[me] = torch.tensor([os.getpid(), fd, nonce, ok])
    dist.all_reduce(every, group=group)  # each rank's row from it (a sum of one row and zeros)
    ok = int(every[:, 3].min())
    ctrl_of: dict[int, torch.Tensor] = {}
    for r in range(size):
        if r == me or not ok:
            continue
        pid, peer_fd, peer_nonce, _ = (int(v) for v in every[r])
        theirs = _open(pid, peer_fd, ctrl_bytes)
        if theirs is None or int(theirs.view(torch.int64)[-1]) != peer_nonce:
            ok = 0
        else:
            ctrl_of[r] = theirs.view(torch.int64)
    agreed = torch.tensor([ok])
    dist.all_reduce(agreed, op=dist.ReduceOp.MIN, group=group)  # all opened all, or the group stays on gloo
    if not int(agreed):
        _close(fds)
        return None
    return SharedRows(group, [int(v) for v in every[:, 0]], ctrl_mine, ctrl_of, fds)
