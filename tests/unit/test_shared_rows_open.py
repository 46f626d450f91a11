"""What ``shardwise.shared_rows`` maps of another process's memory ([Note: shared rows])."""

from __future__ import annotations

import os

import pytest
import torch

from shardwise import shared_rows

pytestmark = pytest.mark.skipif(not shared_rows._supported(), reason="Linux x86-64 with memfd_create only")


def test_only_memory_made_here_of_the_expected_size_is_mapped(tmp_path):
    buf, fd = shared_rows._create(4096)
    buf.fill_(7)
    got = shared_rows._open(os.getpid(), fd, 4096)
    assert got is not None and torch.equal(got, buf)
    got[0] = 9  # the same memory
    assert int(buf[0]) == 9
    assert shared_rows._open(os.getpid(), fd, 8192) is None  # another size: not this buffer
    plain = tmp_path / "f"
    plain.write_bytes(b"x" * 10)
    pfd = os.open(plain, os.O_RDWR)
    try:
        # mapping would extend the file to the size asked for: it is not touched
        assert shared_rows._open(os.getpid(), pfd, 4096) is None
        assert plain.stat().st_size == 10
    finally:
        os.close(pfd)
    assert shared_rows._open(os.getpid(), 10_000, 4096) is None  # no such descriptor
    os.close(fd)


@pytest.mark.parametrize("value,on", [(None, False), ("", False), ("0", False), ("1", True)])
def test_the_setting(monkeypatch, value, on):
    if value is None:
        monkeypatch.delenv(shared_rows.ENV, raising=False)
    else:
        monkeypatch.setenv(shared_rows.ENV, value)
    assert shared_rows.requested() is on
