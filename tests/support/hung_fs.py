"""A file write that really hangs, without FUSE: a named pipe (FIFO) where ``FileStorage`` will open
its temporary file. ``open(fifo, "wb")`` blocks in the kernel until a reader opens the pipe — a
write stuck in a filesystem call, as on a hung NFS server. ``release()`` lets it go (the write then
fails on the pipe and the store removes its temporary file)."""

from __future__ import annotations

import os
import time
import types

from transfer.storage import file as file_module

TEMP_HEX = "0123456789abcdef" * 2  # the temporary-file tag every write gets while installed


class HungWrite:
    """Makes the write of page ``name`` (``{key}{suffix}``) in ``store`` hang until ``release``.

    Installs a fixed temporary-file tag in ``transfer.storage.file`` (``monkeypatch``) and a FIFO at
    that page's temporary path.
    """

    def __init__(self, store, name: str, monkeypatch) -> None:
        fixed = types.SimpleNamespace(hex=TEMP_HEX)
        monkeypatch.setattr(file_module, "uuid", types.SimpleNamespace(uuid4=lambda: fixed))
        self.path = os.path.join(store.directory, f".{name}.bin.{TEMP_HEX}.tmp")
        os.mkfifo(self.path)
        self.name, self.store = name, store

    def wait_stuck(self, limit: float = 10.0) -> None:
        """Until a thread of this process is blocked opening the pipe (the kernel's
        ``wait_for_partner``, read from ``/proc``; where the kernel hides wait channels, until the
        store lists the write in flight). A bounded poll: fails after ``limit``."""
        deadline = time.monotonic() + limit
        while not _blocked_on_fifo() and self.name not in getattr(self.store, "writes_in_flight", list)():
            assert time.monotonic() < deadline, "the write never reached the pipe"
            time.sleep(0.005)

    def release(self, limit: float = 10.0) -> None:
        """Open the pipe's read end (the blocked ``open`` returns) and drain it until the store has
        failed write has removed it (its temporary file; bounded), then close it."""
        fd = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK)
        try:
            deadline = time.monotonic() + limit
            while os.path.lexists(self.path) and time.monotonic() < deadline:
                try:
                    os.read(fd, 1 << 16)
                except BlockingIOError:
                    time.sleep(0.005)
        finally:
            os.close(fd)
        if os.path.lexists(self.path):
            os.unlink(self.path)


def _blocked_on_fifo() -> bool:
    """Whether a thread of this process sleeps in the kernel waiting for a FIFO's other end."""
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/wchan") as f:
                if f.read() == "wait_for_partner":
                    return True
        except OSError:
            continue
    return False
