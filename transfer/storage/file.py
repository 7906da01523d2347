"""File page storage, SGLang HiCacheFile compatible: one file ``{key}{suffix}.bin`` per page.

A file holds the page's raw bytes (host page-first layout), no header. Each page is written to a
temporary file in the same directory (``.{name}.bin.{random}.tmp``) and ``os.replace``d into place,
so a reader sees either no file or the whole page. At start the directory is scanned to rebuild
the index (oldest modification time = least recently used) and stale temporary files left by a
crashed writer of this suffix are removed.

Checksums (``checksum=True``, the default) are kept out of the page bytes, so the ``.bin`` stays
raw (HiCacheFile interop): the page's checksum (``transfer.checksum``: a 64-bit weighted word sum)
and size go in an extended attribute of the file (``user.kv_lifecycle.checksum``), set on the temporary file before it is renamed into place. The page
and its checksum therefore appear together, atomically: a crash at any point leaves no page or a
page with its checksum, never a page that verifies wrongly, and there is no second file per page.
Reads check the size and the checksum (read from the same open file); a page that fails is a counted
miss, its bytes cleared from the caller's buffer, and (checksum mismatch) the file is deleted so a later
write can repair it. A page with no checksum (written by SGLang itself, copied without xattrs, or on
a filesystem without user xattrs) is accepted and counted ``unverified``, or refused as a miss with
``require_checksum=True``.
"""

from __future__ import annotations

import errno
import os
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

from transfer.log import get_logger
import torch

from transfer.checksum import page_checksum
from transfer.errors import StorageUnavailable
from transfer.storage.base import IndexedStorage, StorageStats

log = get_logger(__name__)

XATTR = "user.kv_lifecycle.checksum"  # the page's checksum, an extended attribute of its file
_OVERLAP_BYTES = 256 << 10  # pages at least this big get their checksum computed while being written
_NO_XATTR = (errno.ENODATA, errno.ENOTSUP, errno.EOPNOTSUPP)


class FileStorageStats(StorageStats):
    """``StorageStats`` plus pages refused on read and pages read without a checksum.

    ``corrupt``: checksum mismatch or unreadable checksum. ``wrong_size``: file shorter or longer than
    the page. ``unverified``: pages read with no checksum (accepted, or refused with
    ``require_checksum``). ``stale_indexed``: index entries whose file had vanished.
    """

    corrupt: int = 0
    wrong_size: int = 0
    unverified: int = 0
    stale_indexed: int = 0


def _checksum_bytes(crc: int, size: int) -> bytes:
    return b"wsum64 %016x %d" % (crc, size)


def _parse_checksum(data: bytes) -> tuple[int, int] | None:
    parts = data.split()
    if len(parts) != 3 or parts[0] != b"wsum64":
        return None
    try:
        return int(parts[1], 16), int(parts[2])
    except ValueError:
        return None


def _write_all(f, view: memoryview) -> None:
    """Write all of ``view`` (an unbuffered write may be short, e.g. when the disk fills)."""
    while view.nbytes:
        n = f.write(view)
        if not n:
            raise OSError(errno.ENOSPC, "short write")
        view = view[n:]


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
        checksum: keep a checksum with each page (an xattr of its file) and verify it on read.
        require_checksum: refuse (as a miss) a page with no checksum; default accepts it, counted
            ``unverified`` (pages written by SGLang's HiCacheFile have none).
        write_threads: pages of one ``batch_set`` are written by this many threads at once.
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
        checksum: bool = True,
        require_checksum: bool = False,
        write_threads: int = 2,
    ) -> None:
        super().__init__(suffix, page_nbytes, capacity_bytes, capacity_pages)
        self._stats = FileStorageStats()
        self.directory = os.fspath(directory)
        self.fsync, self.checksum, self.require_checksum = fsync, checksum, require_checksum
        self._warned_no_xattr = False
        self._crc_pool: ThreadPoolExecutor | None = None
        self._writers: ThreadPoolExecutor | None = None
        self.write_threads = write_threads
        self._crc_pool_lock = threading.Lock()
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

    def _write(self, name: str, page: torch.Tensor, overlap: bool = True) -> None:
        final = self._path(name)
        tmp = os.path.join(self.directory, f".{name}.bin.{uuid.uuid4().hex}.tmp")
        data = memoryview(page.reshape(-1).view(torch.uint8).numpy()).cast("B")
        # the checksum releases the GIL (numpy): overlap it with the write on another core
        crc = self._crc_pool_get().submit(page_checksum, data) if (
            overlap and self.checksum and data.nbytes >= _OVERLAP_BYTES) else None
        try:
            with open(tmp, "wb", buffering=0) as f:
                _write_all(f, data)
                if self.checksum:
                    value = crc.result() if crc is not None else page_checksum(data)
                    self._set_checksum(f.fileno(), _checksum_bytes(value, data.nbytes))
                if self.fsync:
                    os.fsync(f.fileno())
            os.replace(tmp, final)  # the page appears with its checksum, or not at all
        except OSError:
            if crc is not None:
                crc.cancel()
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise

    def _write_many(self, items):
        """Pages of a batch are written concurrently (the syscalls release the GIL): one file per
        page costs per-file work that a single sequential file does not, and parallel writers
        recover it."""
        if len(items) < 2 or self.write_threads < 2:
            return super()._write_many(items)

        def one(item):
            try:
                self._write(*item, overlap=False)  # the writers already run in parallel
            except OSError as err:
                return err
            return None

        return list(self._writers_get().map(one, items))

    def _writers_get(self) -> ThreadPoolExecutor:
        with self._crc_pool_lock:
            if self._writers is None:
                self._writers = ThreadPoolExecutor(self.write_threads, thread_name_prefix="kv-file-write")
            return self._writers

    def _set_checksum(self, fd: int, value: bytes) -> None:
        try:
            os.setxattr(fd, XATTR, value)
        except OSError as err:
            if err.errno not in (errno.ENOTSUP, errno.EOPNOTSUPP):
                raise
            if not self._warned_no_xattr:  # the page is still stored: it reads as unverified
                self._warned_no_xattr = True
                log.warning("file_storage.checksum_unsupported", directory=self.directory,
                            error=str(err))

    def _crc_pool_get(self) -> ThreadPoolExecutor:
        with self._crc_pool_lock:
            if self._crc_pool is None:
                self._crc_pool = ThreadPoolExecutor(1, thread_name_prefix="kv-file-crc")
            return self._crc_pool

    def close(self) -> None:
        """Stop the checksum and writer threads (if started)."""
        with self._crc_pool_lock:
            pools = (self._crc_pool, self._writers)
            self._crc_pool = self._writers = None
        for pool in pools:
            if pool is not None:
                pool.shutdown(wait=True)

    def _count(self, field: str) -> None:
        with self._lock:
            setattr(self._stats, field, getattr(self._stats, field) + 1)

    def _read(self, name: str, into: torch.Tensor) -> bool:
        buf = into.reshape(-1).view(torch.uint8).numpy()
        try:
            with open(self._path(name), "rb", buffering=0) as f:
                got = f.readinto(buf.data)
                whole = got == buf.nbytes and f.read(1) == b""
                side = self._get_checksum(f.fileno()) if whole and self.checksum else None
        except FileNotFoundError:
            self._count("stale_indexed")
            log.warning("file_storage.page_vanished", name=name)
            return False
        if not whole:
            self._count("wrong_size")
            log.error("file_storage.wrong_size", name=name, expected=buf.nbytes,
                      size=self._probe(name))
            buf.fill(0)  # never leave a refused page's bytes in the caller's buffer
            return False
        if not self.checksum:
            return True
        if side is None:
            self._count("unverified")
            if self.require_checksum:
                log.warning("file_storage.unverified_refused", name=name)
                buf.fill(0)
                return False
            return True
        crc = page_checksum(buf.data)
        if side != (crc, buf.nbytes):
            self._count("corrupt")
            log.error("file_storage.corrupt_page", name=name, expected=side, crc=crc)
            buf.fill(0)
            self._remove(name)  # a later write can repair it; batch_exists won't re-adopt it
            return False
        return True

    @staticmethod
    def _get_checksum(fd: int) -> tuple[int, int] | tuple[None, None] | None:
        """The stored (crc, size); None if the file has none; (None, None) if unparseable."""
        try:
            raw = os.getxattr(fd, XATTR)
        except OSError as err:
            if err.errno in _NO_XATTR:
                return None
            raise
        return _parse_checksum(raw) or (None, None)

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

    def _present(self, name: str) -> bool:
        if os.path.exists(self._path(name)):
            return True
        self._count("stale_indexed")
        log.warning("file_storage.page_vanished", name=name)
        return False
