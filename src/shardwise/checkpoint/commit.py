"""Where checkpoints live on disk, and how one becomes visible only when whole.

Layout (``save(root, ..., step=N)``; ``save(path, ...)`` uses ``path`` itself)::

    root/
      step-00000100/            a committed checkpoint
        .metadata               torch.distributed.checkpoint's metadata (rank 0)
        __0_0.distcp ...        each rank's shards, as DCP's FileSystemWriter writes them
        extra.pt                the ``extra`` dict (rank 0, torch.save), when given
        complete.json           the completion marker: written last
      best/                     a committed checkpoint too (``save(root / "best", ...)``)
      .step-00000200.tmp-<id>/  a save in progress, or one that died: ignored

[Note: commit protocol]
1. Rank 0 creates ``.<name>.tmp-<id>`` next to the destination (``<id>`` is
   random, broadcast to all ranks) and writes ``extra.pt`` there.
2. Every rank writes its shards with DCP (``sync_files=True``: each file is
   fsync-ed); DCP's coordinator then writes ``.metadata`` (to a temporary name,
   fsync, rename). DCP's final collective means every rank's files exist.
3. Every rank computes the size and CRC-32 of the files it wrote; rank 0
   gathers them, fsyncs the directory, renames it to its final name, fsyncs
   the parent directory, and only then writes ``complete.json`` (temporary
   name, fsync, rename, fsync): the marker lists every file with its size and
   checksum, the step, the world size and the commit's ``sequence`` (one more
   than the highest among the committed checkpoints beside it: the commit
   order, which ``latest`` follows; markers written before it existed have
   none and order by their ``created`` time, before every sequenced one).
If writing the marker fails (a full disk), rank 0 renames the directory back
to its staging name and removes it, and a checkpoint it replaced goes back.
A directory is a checkpoint if and only if it holds a valid marker. A process
killed at any point leaves either a ``.tmp-`` directory (no marker) or, between
the rename and the marker, a final-named directory without a marker; neither is
accepted by ``load`` nor returned by ``latest``, and the next ``save`` to the
same place replaces it. Checkpoints of other steps are never touched (except
by ``keep=``, after the new one is committed). ``load`` checks every file's size
and (spread over the ranks) its checksum before reading anything, so a
truncated or corrupted file is reported, not loaded.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import shutil
import time
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import BinaryIO

from shardwise.errors import CheckpointError, ConfigError

__all__ = [
    "EXTRA_NAME",
    "MARKER_NAME",
    "FileRecord",
    "Marker",
    "atomic_write",
    "check_files",
    "checkpoint_path",
    "checksum_file",
    "commit",
    "fsync_dir",
    "latest",
    "list_checkpoints",
    "new_token",
    "next_sequence",
    "prune",
    "read_marker",
    "remove_uncommitted",
    "stray_entries",
    "temp_dir_for",
    "write_marker",
]

MARKER_NAME = "complete.json"
EXTRA_NAME = "extra.pt"
FORMAT_NAME = "shardwise-checkpoint"
FORMAT_VERSION = 1
STEP_PREFIX = "step-"
_STEP_RE = re.compile(r"^step-(\d+)$")
_STEP_DIGITS = 8
_CRC_CHUNK = 2**20  # small: checksumming must not add to peak memory


@dataclass(frozen=True)
class FileRecord:
    """Size and CRC-32 of one file of a checkpoint."""

    size: int
    crc32: int


@dataclass(frozen=True)
class Marker:
    """Contents of ``complete.json``."""

    files: dict[str, FileRecord]
    world_size: int
    step: int | None = None
    created: float = field(default_factory=time.time)
    version: int = FORMAT_VERSION
    # Commit order among the checkpoints of one root (set by ``commit``); None
    # in markers written before it was added.
    sequence: int | None = None

    def to_json(self) -> str:
        return json.dumps(
            {
                "format": FORMAT_NAME,
                "version": self.version,
                "step": self.step,
                "world_size": self.world_size,
                "created": self.created,
                "sequence": self.sequence,
                "files": {k: {"size": v.size, "crc32": v.crc32} for k, v in sorted(self.files.items())},
            },
            indent=1,
        )


# ---- naming -----------------------------------------------------------------------
def checkpoint_path(root: str | os.PathLike[str], step: int) -> Path:
    """The directory that ``save(root, ..., step=step)`` commits to:
    ``root/step-<step, 8 digits>``."""
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ConfigError(f"step must be an int >= 0, got {step!r}; it names the directory step-<step>.")
    return Path(root) / f"{STEP_PREFIX}{step:0{_STEP_DIGITS}d}"


def new_token() -> str:
    return secrets.token_hex(6)


def temp_dir_for(final: Path, token: str) -> Path:
    """Hidden sibling of ``final`` where a save is staged."""
    return final.parent / f".{final.name}.tmp-{token}"


def _old_dir_for(final: Path, token: str) -> Path:
    return final.parent / f".{final.name}.old-{token}"


def list_checkpoints(root: str | os.PathLike[str]) -> list[tuple[int, Path]]:
    """Every committed ``step-N`` checkpoint under ``root``, as ``(step, path)``,
    oldest first. Directories without a valid completion marker are skipped."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        m = _STEP_RE.match(child.name)
        if m is None or not child.is_dir():
            continue
        try:
            read_marker(child)
        except CheckpointError:
            continue
        found.append((int(m.group(1)), child))
    return sorted(found)


def _committed(root: Path) -> list[tuple[Marker, Path]]:
    """Every directory directly under ``root`` with a valid completion marker,
    whatever its name, hidden ones too (``.old-`` copies of a replaced one)."""
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        if not (child / MARKER_NAME).is_file():
            continue
        try:
            found.append((read_marker(child), child))
        except CheckpointError:
            continue
    return found


def _commit_order(marker: Marker) -> tuple[bool, int, float]:
    """Sort key: sequenced markers by sequence, after the older unsequenced
    ones, which go by their commit time."""
    return (marker.sequence is not None, marker.sequence or 0, marker.created)


def next_sequence(root: Path) -> int:
    """The commit sequence for the next checkpoint committed under ``root``."""
    return 1 + max((m.sequence or 0 for m, _ in _committed(root)), default=0)


def latest(root: str | os.PathLike[str]) -> Path | None:
    """The newest committed checkpoint under ``root``, or ``None`` if there is
    none: of the directories directly under ``root`` that hold a valid
    completion marker, whatever their names (``step-N`` from ``save(root,
    ..., step=N)``, or any ``save(root / name, ...)``), the one committed last
    (by the commit sequence in its marker; for markers written before shardwise
    recorded one, by the commit time they hold, and before any newer one).

    Pure file-system look-up (no communication). Saves in progress or killed
    (no marker), hidden directories (``.<name>.tmp-`` / ``.old-``) and
    directories that are not checkpoints are ignored.

    Args:
        root: the directory that ``save(root, ..., step=N)`` (or ``save(root /
            name, ...)``) writes into.
    """
    found = [(m, p) for m, p in _committed(Path(root)) if not p.name.startswith(".")]
    if not found:
        return None
    return max(found, key=lambda mp: (_commit_order(mp[0]), mp[1].name))[1]


# ---- durability ---------------------------------------------------------------------
def fsync_dir(path: Path) -> None:
    """Make the directory's entries (created / renamed files) durable."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # platforms without directory handles
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_write(path: Path) -> Iterator[BinaryIO]:
    """Write ``path`` through a temporary sibling: flush, fsync, rename, fsync
    the directory. On an exception the temporary file is removed and ``path``
    is left as it was."""
    tmp = path.parent / f".{path.name}.tmp-{new_token()}"
    f = open(tmp, "wb")
    try:
        yield f
        f.flush()
        os.fsync(f.fileno())
        f.close()
        os.replace(tmp, path)
        fsync_dir(path.parent)
    except BaseException:
        f.close()
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise


def checksum_file(path: Path) -> FileRecord:
    """Size and CRC-32 of a file, read in chunks."""
    crc = 0
    size = 0
    buf = bytearray(_CRC_CHUNK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            crc = zlib.crc32(view[:n], crc)
            size += n
    return FileRecord(size, crc)


# ---- the marker ---------------------------------------------------------------------
def write_marker(directory: Path, marker: Marker) -> None:
    with atomic_write(directory / MARKER_NAME) as f:
        f.write(marker.to_json().encode("utf-8"))


def read_marker(directory: Path) -> Marker:
    """Parse ``directory``'s completion marker; :class:`CheckpointError` if the
    directory is not a committed checkpoint."""
    if not directory.exists():
        raise CheckpointError(f"checkpoint path {str(directory)!r} does not exist.")
    if not directory.is_dir():
        raise CheckpointError(
            f"checkpoint path {str(directory)!r} is a file, not a checkpoint directory "
            "(a single exported file loads with load_from_file)."
        )
    path = directory / MARKER_NAME
    if not path.is_file():
        hint = ""
        if list_checkpoints(directory):
            hint = " It holds checkpoints: pass one of them, e.g. shardwise.checkpoint.latest(path)."
        raise CheckpointError(
            f"{str(directory)!r} is not a complete checkpoint: it has no {MARKER_NAME} (the save that "
            f"wrote it never finished, or it is not a checkpoint).{hint}"
        )
    try:
        raw = json.loads(path.read_text("utf-8"))
        if raw.get("format") != FORMAT_NAME:
            raise ValueError(f"format is {raw.get('format')!r}")
        if raw.get("version") != FORMAT_VERSION:
            raise ValueError(f"version {raw.get('version')!r} is not {FORMAT_VERSION}")
        files = {str(k): FileRecord(int(v["size"]), int(v["crc32"])) for k, v in raw["files"].items()}
        step = raw.get("step")
        sequence = raw.get("sequence")
        return Marker(
            files=files,
            world_size=int(raw["world_size"]),
            step=None if step is None else int(step),
            created=float(raw.get("created", 0.0)),
            sequence=None if sequence is None else int(sequence),
        )
    except (ValueError, KeyError, TypeError, AttributeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{str(path)!r} is corrupted ({exc}); this checkpoint cannot be trusted.") from None


def check_files(directory: Path, marker: Marker, names: list[str] | None) -> list[str]:
    """Problems with ``directory``'s files against ``marker``: every file's size,
    and the checksum of those in ``names`` (all when ``None``)."""
    problems = []
    for name, record in sorted(marker.files.items()):
        path = directory / name
        try:
            size = path.stat().st_size
        except OSError:
            problems.append(f"{name} is missing")
            continue
        if size != record.size:
            what = "truncated" if size < record.size else "longer than written"
            problems.append(f"{name} has {size} bytes, {record.size} were written ({what})")
            continue
        if (names is None or name in names) and checksum_file(path).crc32 != record.crc32:
            problems.append(f"{name} is corrupted (its CRC-32 does not match the one written)")
    return problems


# ---- commit -----------------------------------------------------------------------
def remove_uncommitted(final: Path) -> None:
    """Remove what earlier saves to ``final`` left behind when they died:
    ``.tmp-`` / ``.old-`` siblings, and ``final`` itself if it has no marker."""
    if final.parent.is_dir():
        for child in final.parent.iterdir():
            if child.name.startswith((f".{final.name}.tmp-", f".{final.name}.old-")) and child.is_dir():
                shutil.rmtree(child, ignore_errors=True)
    if final.is_dir() and not (final / MARKER_NAME).is_file():
        strangers = [c.name for c in final.iterdir() if not _is_checkpoint_file(c.name)]
        if strangers:
            # Never delete what we did not write: this is somebody's directory.
            raise CheckpointError(
                f"save: {str(final)!r} exists and holds files that are not part of a shardwise "
                f"checkpoint ({', '.join(sorted(strangers)[:5])}); refusing to replace it. Save to a "
                "new or empty directory, or pass step= to save under it as step-NNNNNNNN/."
            )
        shutil.rmtree(final, ignore_errors=True)


def stray_entries(root: Path) -> list[str]:
    """Names directly under ``root`` (a directory of checkpoints) that no
    save wrote: anything but directories holding a marker, the hidden
    ``.<name>.tmp-`` / ``.old-`` directories of saves in progress or killed,
    and marker-less directories holding only checkpoint files (a save killed
    between rename and marker)."""
    stray = []
    for child in sorted(root.iterdir()) if root.is_dir() else []:
        if child.is_dir():
            if (child / MARKER_NAME).is_file():
                continue
            if child.name.startswith(".") and (".tmp-" in child.name or ".old-" in child.name):
                continue
            inside = [c.name for c in child.iterdir()]
            if all(_is_checkpoint_file(n) for n in inside) and (inside or _STEP_RE.match(child.name)):
                continue
        stray.append(child.name)
    return stray


def _is_checkpoint_file(name: str) -> bool:
    """Files a (possibly half-committed) checkpoint directory may hold."""
    return (
        name in (MARKER_NAME, EXTRA_NAME, ".metadata")
        or name.endswith(".distcp")
        or name.startswith((".metadata.", f".{MARKER_NAME}.", f"{MARKER_NAME}."))
    )


def commit(tmp: Path, final: Path, marker: Marker, token: str) -> None:
    """Make the staged checkpoint ``tmp`` visible as ``final`` (see the note);
    the marker written gets the next commit sequence under ``final``'s parent."""
    marker = replace(marker, sequence=next_sequence(final.parent))
    fsync_dir(tmp)
    old = None
    if final.exists():
        # Only reached with overwrite=True or for a marker-less leftover.
        old = _old_dir_for(final, token)
        os.replace(final, old)
    os.replace(tmp, final)
    fsync_dir(final.parent)
    try:
        write_marker(final, marker)
    except BaseException:
        # Not committed after all (a full disk, say): the directory goes back to its staging name (the
        # caller removes it) and the checkpoint it replaced back in place.
        with contextlib.suppress(OSError):
            os.replace(final, tmp)
            if old is not None:
                os.replace(old, final)
            fsync_dir(final.parent)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def prune(root: Path, keep: int) -> list[Path]:
    """Delete all but the newest ``keep`` committed checkpoints under ``root``
    (marker first, so that a half-deleted one is never taken for whole)."""
    removed = []
    for _, path in list_checkpoints(root)[:-keep] if keep > 0 else []:
        with contextlib.suppress(OSError):
            (path / MARKER_NAME).unlink()
            fsync_dir(path)
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed
