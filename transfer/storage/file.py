"""File page storage, SGLang HiCacheFile compatible: one file ``{key}{suffix}.bin`` per page.

A file holds the page's raw bytes (host page-first layout), no header. Each page is written to a
temporary file in the same directory (``.{name}.bin.{32 hex}.tmp``) and ``os.replace``d into place,
so a reader sees either no file or the whole page. At start the directory is scanned to rebuild
the index (oldest modification time = least recently used) and stale temporary files left by a
crashed writer of this suffix are removed.

**Ownership.** A file is this store's only if its whole name parses as ``{64 hex}{suffix}.bin``
(or, for a temporary file, ``.{64 hex}{suffix}.bin.{32 hex}.tmp``) with exactly this store's suffix.
Only such files are indexed, evicted, cleaned or deleted: another deployment's file or temp file
is never touched, whatever its suffix ends with (``_team-ft_Llama_0_1`` is not ``_Llama_0_1``).
Nor is a file of our exact name whose seal proves another deployment wrote it (another host
layout, dtype or page name: ``integrity.written_by_another``): it is not indexed at start, not
replaced by a write (reported stored, counted ``foreign_kept``), not evicted, not deleted.

**Seal.** With ``checksum=True`` (the default) the page's seal (``transfer.storage.integrity``:
XXH3-128 over name, layout, dtype, shape, size and bytes) is an extended attribute of the file
(``user.kv_lifecycle.checksum``), set on the temporary file before it is renamed into place, so
the ``.bin`` stays raw (HiCacheFile interop) and the page appears with its seal or not at all.
Reads check the size and the seal (read from the same open file); a page that fails is a counted
miss, its bytes cleared from the caller's buffer, and a corrupt file is deleted so a later write
can repair it. A page with no seal (written by SGLang, copied with ``cp -r`` without xattrs, on a
filesystem without user xattrs, or sealed by an older version) is served and counted
``unverified`` with a one-time warning, or refused as a miss with ``require_checksum=True``.
"""

from __future__ import annotations

import errno
import os
import re
import stat
import threading
import time
import uuid

from transfer.log import RateLimitedLog, get_logger
import torch

from transfer.errors import StorageUnavailable
from transfer.storage.base import IndexedStorage, StorageStats
from transfer.shutdown import DEFAULT_CLOSE_TIMEOUT_S, check_timeout
from transfer.storage.checks import check_seconds, check_size
from transfer.storage.writers import InFlight, WriterThreads
from transfer.storage.integrity import PageFormat, Verdict, check_seal, decode_seal, written_by_another

log = get_logger(__name__)

XATTR = "user.kv_lifecycle.checksum"  # the page's seal, an extended attribute of its file
_NO_XATTR = (errno.ENODATA, errno.ENOTSUP, errno.EOPNOTSUPP)


class FileStorageStats(StorageStats):
    """``StorageStats`` plus ``stale_indexed``: index entries whose file had vanished (deleted or
    evicted by another process sharing the directory)."""

    stale_indexed: int = 0


def _write_all(f, view: memoryview) -> None:
    """Write all of ``view`` (an unbuffered write may be short, e.g. when the disk fills)."""
    while view.nbytes:
        n = f.write(view)
        if not n:
            raise OSError(errno.ENOSPC, "short write")
        view = view[n:]


def name_patterns(suffix: str) -> tuple[re.Pattern, re.Pattern]:
    """Exact patterns of this suffix's page files and temporary files (group 1: the page hash)."""
    tail = re.escape(suffix) + r"\.bin"
    return re.compile(r"([0-9a-f]{64})" + tail + r"\Z"), re.compile(r"\.([0-9a-f]{64})" + tail + r"\.[0-9a-f]{32}\.tmp\Z")


class FileStorage(IndexedStorage):
    """Pages as files in ``directory``.

    Args:
        directory: created if missing; must be writable.
        suffix: deployment suffix (``hashing.storage_suffix``); only files named exactly
            ``{64 hex}{suffix}.bin`` (and this suffix's temp files) are indexed, evicted or cleaned.
        page_nbytes: required page size (None: any); indexed files of another size are ignored.
        capacity_bytes / capacity_pages: LRU eviction bounds over this suffix's files.
        fsync: fsync each page before renaming it into place (durability across power loss).
        stale_temp_s: this suffix's temporary files at least this old are removed at start.
        checksum: seal each page (an xattr of its file) and verify the seal on read.
        require_checksum: strict mode: refuse (as a miss) a page with no seal; the default serves
            it, counted ``unverified`` and warned once (pages written by SGLang's HiCacheFile
            have none). The CLI exposes it as ``--require-checksum``.
        write_threads: pages of one ``batch_set`` are written by this many threads at once.
        page_format: what the pages are (``IndexedStorage``); the transfer stack passes
            ``PageFormat("page_first", dtype, host page shape)``.
    Raises:
        StorageUnavailable: the directory cannot be created or written.
        StorageConfigError: a suffix that cannot be part of a file name; ``page_nbytes``,
            a capacity or ``write_threads`` not a positive int; ``stale_temp_s`` negative or not
            finite; a ``page_format`` that is not byte-exact or not ``page_nbytes`` bytes
            (``transfer.storage.checks``). Nothing is created.
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
        page_format: PageFormat | None = None,
    ) -> None:
        check_size("write_threads", write_threads, optional=False)
        check_seconds("stale_temp_s", stale_temp_s)
        super().__init__(suffix, page_nbytes, capacity_bytes, capacity_pages, page_format=page_format,
                         checksum=checksum, require_checksum=require_checksum)
        self._file_oplog = RateLimitedLog(log)   # per-page events of this store: one line per interval
        self._stats = FileStorageStats()
        self.directory = os.fspath(directory)
        self.fsync = fsync
        self._page_re, self._temp_re = name_patterns(self.suffix)
        self._warned_no_xattr = False
        self._writers: WriterThreads | None = None
        self._in_flight = InFlight()
        self.write_threads = write_threads
        self._pool_lock = threading.Lock()
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
        found, now = [], time.time()
        with os.scandir(self.directory) as entries:
            for entry in entries:
                page, temp = self._page_re.match(entry.name), self._temp_re.match(entry.name)
                if (page is None and temp is None) or not entry.is_file(follow_symlinks=False):
                    continue  # not ours: never touched
                st = entry.stat(follow_symlinks=False)
                if temp is not None:
                    if now - st.st_mtime >= stale_temp_s:
                        try:
                            os.unlink(entry.path)
                            log.info("file_storage.removed_stale_temp", path=entry.path)
                        except FileNotFoundError:
                            pass
                    continue
                if self.page_nbytes is not None and st.st_size != self.page_nbytes:
                    self._file_oplog.warning("file_storage.ignored_wrong_size", path=entry.path, size=st.st_size)
                    continue
                name = entry.name[: -len(".bin")]
                if written_by_another(self._xattr(entry.path), st.st_size, name, self.page_format):
                    continue  # another deployment's page under our name: never indexed, so never evicted
                found.append((st.st_mtime, name, st.st_size))
        found.sort()
        evicted = []
        for _, name, size in found:
            evicted += self._index.add(name, size)
        self._evict(evicted)

    def _write(self, name: str, page: torch.Tensor, seal_bytes: bytes | None) -> None:
        final = self._path(name)
        tmp = os.path.join(self.directory, f".{name}.bin.{uuid.uuid4().hex}.tmp")
        data = memoryview(page.reshape(-1).view(torch.uint8).numpy()).cast("B")
        with self._in_flight.running(name):
            self._write_file(tmp, final, data, seal_bytes)

    def _write_file(self, tmp: str, final: str, data: memoryview, seal_bytes: bytes | None) -> None:
        try:
            with open(tmp, "wb", buffering=0) as f:
                _write_all(f, data)
                if seal_bytes is not None:
                    self._set_seal(f.fileno(), seal_bytes)
                if self.fsync:
                    os.fsync(f.fileno())
            os.replace(tmp, final)  # the page appears with its seal, or not at all
        except OSError:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise

    def _write_many(self, items):
        """Pages of a batch are sealed and written concurrently (the syscalls release the GIL): one
        file per page costs per-file work that a single sequential file does not, and parallel
        writers recover it."""
        if len(items) < 2 or self.write_threads < 2:
            return super()._write_many(items)

        def one(item):
            name, page = item
            try:  # sealing here overlaps the hash with the other writers' write syscalls
                self._write(name, page, self._seal(name, page))
            except OSError as err:
                return err
            return None

        return list(self._writers_get().map(one, items))

    def _writers_get(self) -> WriterThreads:
        with self._pool_lock:
            if self._writers is None:
                self._writers = WriterThreads(self.write_threads, "kv-file-write")
            return self._writers

    def _set_seal(self, fd: int, value: bytes) -> None:
        try:
            os.setxattr(fd, XATTR, value)
        except OSError as err:
            if err.errno not in (errno.ENOTSUP, errno.EOPNOTSUPP):
                raise
            if not self._warned_no_xattr:  # the page is still stored: it reads as unverified
                self._warned_no_xattr = True
                log.warning("file_storage.checksum_unsupported", directory=self.directory,
                            error=str(err))

    def writes_in_flight(self) -> list[str]:
        """Names of the pages being written now (on any thread), sorted. Never blocks."""
        return self._in_flight.names()

    def close(self, timeout: float | None = DEFAULT_CLOSE_TIMEOUT_S) -> list[str]:
        """Stop the writer threads, waiting at most ``timeout`` seconds in all (default
        ``DEFAULT_CLOSE_TIMEOUT_S``; None: until every write has ended) for the page writes in
        flight. A write still running at the deadline (a filesystem call that hangs, as on a stuck
        NFS server) cannot be cancelled: it is abandoned — its thread is a daemon thread left
        behind, its temporary file is removed if it ever fails, and ``file_storage.close_abandoned``
        is logged at ERROR. A later ``batch_set`` starts new writer threads.

        Returns:
            The names of the page writes abandoned (empty when all ended in time).
        Raises:
            ValueError: ``timeout`` negative or not a number.
        """
        check_timeout(timeout)
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._pool_lock:
            pool, self._writers = self._writers, None
        if pool is not None:
            pool.close(timeout)
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        abandoned = self._in_flight.wait(left)
        if abandoned:
            log.error("file_storage.close_abandoned", directory=self.directory, timeout=timeout,
                      pages=abandoned, detail="page writes still running at the close deadline (a hung "
                      "filesystem call cannot be cancelled); their threads are left behind")
        self._file_oplog.flush()
        super().close()  # the rate-limited per-page log lines' summary
        return abandoned

    def _read(self, name: str, into: torch.Tensor) -> tuple[bool, bytes | None]:
        buf = into.reshape(-1).view(torch.uint8).numpy()
        try:
            with open(self._path(name), "rb", buffering=0, opener=_no_follow) as f:
                got = f.readinto(buf.data)
                whole = got == buf.nbytes and f.read(1) == b""
                sealed = self._get_seal(f.fileno()) if whole and self.checksum else None
        except FileNotFoundError:
            self._count("stale_indexed")
            self._file_oplog.warning("file_storage.page_vanished", name=name)
            return False, None
        if not whole:
            self._count("wrong_size")
            self._file_oplog.error("file_storage.wrong_size", name=name, expected=buf.nbytes, size=self._probe(name))
            return False, None
        return True, sealed

    @staticmethod
    def _get_seal(fd: int) -> bytes | None:
        """The stored seal; None if the file has none (or an older version's checksum, which
        cannot be verified any more: the page reads as unverified)."""
        try:
            raw = os.getxattr(fd, XATTR)
        except OSError as err:
            if err.errno in _NO_XATTR:
                return None
            raise
        return None if raw.startswith(b"wsum64 ") else raw

    def _remove(self, name: str) -> bool:
        path = self._path(name)
        if os.path.islink(path):  # a link named like a page is not this store's file: left alone
            return False
        try:
            os.unlink(path)
            return True
        except FileNotFoundError:
            return False

    @staticmethod
    def _xattr(path: str) -> bytes | None:
        """The seal xattr of ``path`` itself (a link is not followed); None: none or unreadable."""
        try:
            return os.getxattr(path, XATTR, follow_symlinks=False)
        except OSError:
            return None

    def _stored_seal(self, name: str) -> tuple[int, bytes | None] | None:
        """(size, seal) of the regular file under ``name`` (``stat`` + ``getxattr``, no read)."""
        size = self._probe(name)
        return None if size is None else (size, self._xattr(self._path(name)))

    def _probe(self, name: str) -> int | None:
        """Size of the regular file under ``name`` (None: none, or a link or other non-file)."""
        try:
            st = os.stat(self._path(name), follow_symlinks=False)
        except OSError:
            return None
        return st.st_size if stat.S_ISREG(st.st_mode) else None

    def _adoptable(self, name: str) -> int | None:
        """Size of ``name`` if it is a page this store would serve, judged without reading it: a
        ``stat`` and a ``getxattr`` (a regular file, never a link, as at start; its seal must name
        this page, this format and this size; a page without a seal counts unless
        ``require_checksum``)."""
        size = self._probe(name)  # None: no file, or a link or anything else not this store's file
        if size is None:
            return None
        path = self._path(name)
        if self.page_nbytes is not None and size != self.page_nbytes:
            return None
        if not self.checksum:
            return size
        try:
            raw = os.getxattr(path, XATTR)
        except OSError as err:
            if err.errno not in _NO_XATTR:
                return None
            raw = None
        if raw is None or raw.startswith(b"wsum64 "):
            return None if self.require_checksum else size
        sealed = decode_seal(raw)
        fmt = self.page_format if self.page_format is not None else (sealed.format if sealed else None)
        if sealed is None or check_seal(sealed, name, fmt, size) is not Verdict.OK:
            return None
        return size

    def _present(self, name: str) -> bool:
        if self._adoptable(name) is not None:
            return True
        self._count("stale_indexed")
        self._file_oplog.warning("file_storage.page_vanished", name=name, size=self._probe(name))
        return False


def _no_follow(path: str, flags: int) -> int:
    """``open``'s opener for page reads: a link under a page's name fails (ELOOP) instead of being
    followed to a file that is not this store's."""
    return os.open(path, flags | os.O_NOFOLLOW)
