"""File page storage, SGLang HiCacheFile compatible: one file ``{key}{suffix}.bin`` per page.

A file holds the page's raw bytes (host page-first layout), no header. Each page is written to a
temporary file in the same directory (``.{name}.{random}.tmp``) and ``os.replace``d into place,
so a reader sees either no file or the whole page. At start the directory is scanned to rebuild
the index (oldest modification time = least recently used) and stale temporary files left by a
crashed writer of this suffix are removed.
"""

from __future__ import annotations

import os
import time
import uuid

import structlog
import torch

from transfer.errors import StorageUnavailable
from transfer.storage.base import IndexedStorage

log = structlog.get_logger(__name__)


class FileStorage(IndexedStorage):
    """Pages as files in ``directory``.

    Args:
        directory: created if missing; must be writable.
        suffix: deployment suffix (``hashing.storage_suffix``); only ``*{suffix}.bin`` files are
            indexed, evicted or cleaned.
        page_nbytes: required page size (None: any); indexed files of another size are ignored.
        capacity_bytes / capacity_pages: LRU eviction bounds over this suffix's files.
        fsync: fsync each page before renaming it into place (durability across power loss).
        stale_temp_s: temporary files older than this are removed at start.
    Raises:
        StorageUnavailable: the directory cannot be created or written.
    """

    def __init__(
        self,
        directory: str | os.PathLike,
        suffix: str = "",
        page_nbytes: int | None = None,
        capacity_bytes: int | None = None,
        capacity_pages: int | None = None,
        fsync: bool = False,
        stale_temp_s: float = 60.0,
    ) -> None:
        super().__init__(suffix, page_nbytes, capacity_bytes, capacity_pages)
        self.directory = os.fspath(directory)
        self.fsync = fsync
        try:
            os.makedirs(self.directory, exist_ok=True)
            probe = os.path.join(self.directory, f".probe.{uuid.uuid4().hex}.tmp")
            with open(probe, "wb"):
                pass
            os.unlink(probe)
        except OSError as err:
            raise StorageUnavailable(f"storage directory {self.directory!r} is not writable: {err}") from err
        self._rebuild_index(stale_temp_s)

    def _path(self, name: str) -> str:
        return os.path.join(self.directory, name + ".bin")

    def _rebuild_index(self, stale_temp_s: float) -> None:
        tail, found, now = self.suffix + ".bin", [], time.time()
        with os.scandir(self.directory) as entries:
            for entry in entries:
                if not entry.is_file(follow_symlinks=False):
                    continue
                st = entry.stat(follow_symlinks=False)
                if entry.name.startswith(".") and entry.name.endswith(".tmp") and tail + "." in entry.name:
                    if now - st.st_mtime >= stale_temp_s:
                        os.unlink(entry.path)
                        log.info("file_storage.removed_stale_temp", path=entry.path)
                    continue
                if entry.name.endswith(tail) and not entry.name.startswith("."):
                    if self.page_nbytes is not None and st.st_size != self.page_nbytes:
                        log.warning("file_storage.ignored_wrong_size", path=entry.path, size=st.st_size)
                        continue
                    found.append((st.st_mtime, entry.name[: -len(".bin")], st.st_size))
        found.sort()
        evicted = []
        for _, name, size in found:
            evicted += self._index.add(name, size)
        self._evict(evicted)

    def _write(self, name: str, page: torch.Tensor) -> None:
        final = self._path(name)
        tmp = os.path.join(self.directory, f".{name}.bin.{uuid.uuid4().hex}.tmp")
        try:
            with open(tmp, "wb", buffering=0) as f:
                f.write(page.reshape(-1).view(torch.uint8).numpy().data)
                if self.fsync:
                    os.fsync(f.fileno())
            os.replace(tmp, final)
        except OSError:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise

    def _read(self, name: str, into: torch.Tensor) -> bool:
        buf = into.reshape(-1).view(torch.uint8).numpy()
        try:
            with open(self._path(name), "rb", buffering=0) as f:
                if f.readinto(buf.data) != buf.nbytes:
                    return False
                return f.read(1) == b""
        except FileNotFoundError:
            return False

    def _remove(self, name: str) -> None:
        try:
            os.unlink(self._path(name))
        except FileNotFoundError:
            pass

    def _probe(self, name: str) -> int | None:
        try:
            return os.stat(self._path(name)).st_size
        except OSError:
            return None
