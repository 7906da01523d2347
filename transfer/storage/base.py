"""The storage interface: batch operations on whole KV pages named by page hash.

A backend stores page ``key`` (a page hash: 64 lowercase hex characters, checked before any page
of a batch is touched) under the name ``{key}{suffix}`` (SGLang HiCacheFile naming; the suffix
comes from ``hashing.storage_suffix``). Every page is sealed (``transfer.storage.integrity``): a
read serves a page only if it is exactly the page asked for — same name, same format (layout,
dtype, shape), same bytes. ``IndexedStorage`` implements the shared behaviour (skip existing keys
that are really there, LRU eviction under a capacity bound, sealing and verification, stats,
failure accounting) over primitives a backend provides; it is safe to call from several threads,
and holds its lock only for index updates, never during I/O.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Sequence

import msgspec
from transfer.log import RateLimitedLog, get_logger
import torch

from transfer.storage.checks import check_batch, check_store  # noqa: F401 (check_batch re-exported)
from transfer.storage.integrity import (
    PageFormat, Verdict, check_keys, check_suffix, raw_format, seal, verify, written_by_another,
)
from transfer.storage.lru import LruIndex

log = get_logger(__name__)


class StorageStats(msgspec.Struct):
    """Counters of one storage backend since construction (``pages``/``bytes``: current contents).

    ``corrupt``: pages refused because their seal or digest did not match (changed bytes, a value
    that is not a page). ``foreign``: pages refused because they are another page or another
    format (renamed onto this key; another layout, dtype or shape). ``wrong_size``: stored size
    differs from the page size. ``unverified``: pages read that carry no seal (written by SGLang,
    copied without xattrs, ``checksum=False``): served in the default mode, refused as misses in
    strict mode (``require_checksum=True``); the first one per store logs a warning.
    ``unavailable``: calls refused or failed because the tier was unreachable (circuit breaker).
    ``foreign_kept``: pages another deployment wrote under one of our page names (its seal names
    another format or another page: ``integrity.written_by_another``; Mooncake: also K/V objects
    of other bytes without our seal) that a write, an eviction or a delete found and left alone —
    never overwritten, repaired or removed. A write reports such a page stored ("already there",
    as SGLang does: not a failure, not in ``stored`` or ``skipped``); a read of it is a
    ``foreign`` miss.
    """

    pages: int = 0
    bytes: int = 0
    stored: int = 0
    skipped: int = 0
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    deletes: int = 0
    errors: int = 0
    corrupt: int = 0
    foreign: int = 0
    wrong_size: int = 0
    unverified: int = 0
    unavailable: int = 0
    foreign_kept: int = 0


class Storage(ABC):
    """Batch page storage of contiguous CPU tensors, named by page hash.

    Every entry point validates its whole batch first: a key that is not a page hash raises
    ``InvalidKey`` (a ``TransferError``) and nothing is read, written or deleted.
    ``page_format`` (when set) is what the pages are; a stored page of another format is a miss.
    """

    suffix: str
    page_nbytes: int | None
    page_format: PageFormat | None = None
    # KV-event hook (``transfer.kv_events.TierAnnouncer``): told of every page this store writes
    # (``stored``) and evicts or deletes (``removed``), by page hash, in order. None: no events.
    events = None

    @abstractmethod
    def batch_set(self, keys: Sequence[str], pages: Sequence[torch.Tensor]) -> list[bool]:
        """Store ``pages[i]`` under ``keys[i]``; a key already stored is skipped (and is a success).

        Returns:
            Per key, whether the page is stored afterwards (True never means "skipped because
            the index said so": the backend checked the page is there) — ours, or a page another
            deployment stored first under the same name, which is left alone ("already there",
            counted ``foreign_kept``; a read of it is a ``foreign`` miss). Pages are independent: a
            failed page does not stop the others (a backend may write them concurrently); each
            failure is counted and logged.
        Raises:
            InvalidKey: a key that is not a page hash. InvalidPage (a ValueError):
            ``len(keys) != len(pages)``, a page that is not a contiguous CPU tensor of a
            byte-exact dtype (``checks.check_page``). PageSizeMismatch: a page of the wrong size.
            All are raised before anything is written (``checks.check_batch``).
        """

    @abstractmethod
    def batch_get(self, keys: Sequence[str], into: Sequence[torch.Tensor]) -> list[bool]:
        """Read page ``keys[i]`` into the contiguous CPU tensor ``into[i]``.

        Returns:
            Per key, whether it was found, read in full and verified. A refused page's bytes are
            never left in ``into[i]`` (a backend that read them into it zeroes it).
        Raises:
            InvalidKey / ValueError / PageSizeMismatch: as ``batch_set``, before anything is read.
        """

    @abstractmethod
    def batch_exists(self, keys: Sequence[str]) -> int:
        """The length of the longest prefix of ``keys`` that is stored (checked against the
        backend, not only a local index). Raises InvalidKey before asking anything."""

    @abstractmethod
    def delete(self, key: str) -> bool:
        """Remove ``key``. Returns whether a page was removed. Raises InvalidKey."""

    @abstractmethod
    def stats(self) -> StorageStats:
        """A snapshot of the counters."""

    def close(self, timeout: float | None = None) -> list[str]:
        """Release resources, waiting at most ``timeout`` seconds (None: without bound) for page
        writes in flight; a write still running then is abandoned, never waited on forever.

        Returns:
            The names of the page writes abandoned (default: nothing to wait for, ``[]``).
        """
        oplog = getattr(self, "_oplog", None)
        if oplog is not None:  # the summary of rate-limited per-page log lines
            oplog.flush()
        return []


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class UnverifiedWarning:
    """Counts a store's unverified reads and logs the first one (once per store, a warning)."""

    def __init__(self, store: str) -> None:
        self.store, self._warned = store, False

    def note(self, name: str, strict: bool) -> None:
        if not self._warned:
            self._warned = True
            log.warning("storage.unverified_page", store=self.store, name=name,
                        served=not strict, hint="pages without a checksum seal (written by SGLang, copied "
                        "without xattrs, or checksum=False) are served unverified; require_checksum=True "
                        "refuses them")


class IndexedStorage(Storage):
    """Shared behaviour over ``_write`` / ``_read`` / ``_remove`` primitives.

    Args:
        suffix: appended to every key to form a page's name.
        page_nbytes: required page size in bytes (None: any size).
        capacity_bytes / capacity_pages: LRU eviction bounds (None: unbounded).
        page_format: what the pages are (None: each page's own dtype and shape, layout ``raw``).
        checksum: seal pages on write and verify seals on read (False: neither; reads count as
            unverified).
        require_checksum: strict mode: a page without a seal is a miss (default: served, counted
            ``unverified``, warned once per store).
    Raises:
        StorageConfigError: a bad suffix, a size that is not a positive int, or a format
            ``checks.check_format`` refuses (not byte-exact, or not ``page_nbytes`` bytes).
    """

    def __init__(
        self,
        suffix: str = "",
        page_nbytes: int | None = None,
        capacity_bytes: int | None = None,
        capacity_pages: int | None = None,
        *,
        page_format: PageFormat | None = None,
        checksum: bool = True,
        require_checksum: bool = False,
    ) -> None:
        check_store(page_nbytes, page_format, capacity_bytes=capacity_bytes, capacity_pages=capacity_pages)
        self.suffix, self.page_nbytes = check_suffix(suffix), page_nbytes
        self._oplog = RateLimitedLog(log)   # per-page failures: one line per event per interval
        self.page_format, self.checksum, self.require_checksum = page_format, checksum, require_checksum
        self._index = LruIndex(capacity_bytes, capacity_pages)
        self._lock = threading.Lock()
        self._stats = StorageStats()
        self._unverified_warning = UnverifiedWarning(type(self).__name__)

    # -- primitives ---------------------------------------------------------------------------
    @abstractmethod
    def _write(self, name: str, page: torch.Tensor, seal_bytes: bytes | None) -> None:
        """Store ``page`` and its seal (None: none) under ``name`` atomically. Raises OSError."""

    @abstractmethod
    def _read(self, name: str, into: torch.Tensor) -> tuple[bool, bytes | None]:
        """Fill ``into`` from ``name``: (whether it was there with exactly ``into``'s size, its
        seal or None). Returns (False, None) if absent. Raises OSError on I/O failure."""

    @abstractmethod
    def _remove(self, name: str) -> bool:
        """Delete ``name`` if present; whether it was. Raises OSError on failure."""

    def _probe(self, name: str) -> int | None:
        """Size of ``name`` if stored by someone else since the index was built (default: None)."""
        return None

    def _adoptable(self, name: str) -> int | None:
        """Size of unindexed ``name`` if it holds a page this store would serve (default:
        ``_probe``); None otherwise."""
        return self._probe(name)

    def _stored_seal(self, name: str) -> tuple[int, bytes | None] | None:
        """(page bytes stored under ``name``, its seal or None) without reading the page, or
        None when nothing this store could overwrite or remove is there (default: None)."""
        return None

    def _foreign(self, name: str, fmt: PageFormat | None) -> bool:
        """Whether the page under ``name`` is provably another deployment's
        (``integrity.written_by_another``); counted ``foreign_kept`` when it is."""
        found = self._stored_seal(name)
        if found is None or not written_by_another(found[1], found[0], name, fmt):
            return False
        self._count("foreign_kept")
        log.debug("storage.foreign_page_kept", store=type(self).__name__, name=name)
        return True

    def _present(self, name: str) -> bool:
        """Whether indexed ``name`` is still stored (a backend whose data can vanish behind the
        index checks; default: True). False drops it from the index."""
        return True

    # -- behaviour ----------------------------------------------------------------------------
    def _check(self, keys: Sequence[str], pages: Sequence[torch.Tensor]) -> None:
        check_batch(keys, pages, self.page_nbytes)

    def _format(self, page: torch.Tensor) -> PageFormat:
        return self.page_format if self.page_format is not None else raw_format(page)

    def _count(self, field: str, n: int = 1) -> None:
        with self._lock:
            setattr(self._stats, field, getattr(self._stats, field) + n)

    def _evict(self, names: list[str]) -> None:
        gone = []
        for name in names:
            try:
                if not self._foreign(name, self.page_format):  # another deployment's page now: kept
                    self._remove(name)
                gone.append(name[:64])
            except OSError as err:
                self._oplog.warning("storage.evict_failed", name=name, error=str(err))
        if names:
            self._count("evictions", len(names))
        if gone and self.events is not None:
            self.events.removed(gone)

    def batch_set(self, keys: Sequence[str], pages: Sequence[torch.Tensor]) -> list[bool]:
        self._check(keys, pages)
        results = [False] * len(keys)
        todo = []
        for i, (key, page) in enumerate(zip(keys, pages)):
            name = key + self.suffix
            with self._lock:
                known = self._index.touch(name)
            if known:
                if self._present(name):  # True means on disk: the index alone is not trusted
                    self._count("skipped")
                    results[i] = True
                    continue
                with self._lock:
                    self._index.remove(name)
            if self._foreign(name, self._format(page)):  # another deployment's page: already there
                results[i] = True
                continue
            todo.append((i, name, page))
        for (i, name, page), err in zip(todo, self._write_many([(n, p) for _, n, p in todo])):
            if err is not None:
                self._count("errors")
                self._oplog.error("storage.write_failed", name=name, errno=err.errno, error=str(err))
                continue
            with self._lock:
                evicted = self._index.add(name, _nbytes(page))
                self._stats.stored += 1
            if self.events is not None:
                self.events.stored([name[:64]])
            self._evict(evicted)
            results[i] = True
        return results

    def _seal(self, name: str, page: torch.Tensor) -> bytes | None:
        if not self.checksum:
            return None
        return seal(name, self._format(page), memoryview(page.reshape(-1).view(torch.uint8).numpy()))

    def _write_many(self, items: list[tuple[str, torch.Tensor]]) -> list[OSError | None]:
        """Seal and write each ``(name, page)``; per item, the OSError it failed with or None.
        Default: one after the other; a backend may write them concurrently."""
        errors: list[OSError | None] = []
        for name, page in items:
            try:
                self._write(name, page, self._seal(name, page))
                errors.append(None)
            except OSError as err:
                errors.append(err)
        return errors

    def _verify(self, name: str, buf: torch.Tensor, sealed: bytes | None) -> bool:
        """Whether the page just read into ``buf`` may be served; counts and logs refusals."""
        if sealed is None or not self.checksum:
            self._count("unverified")
            self._unverified_warning.note(name, self.require_checksum)
            return not self.require_checksum
        verdict = verify(sealed, name, self._format(buf), memoryview(buf.reshape(-1).view(torch.uint8).numpy()))
        if verdict is Verdict.OK:
            return True
        self._count(verdict.value)
        self._oplog.error("storage.page_refused", name=name, verdict=verdict.value)
        if verdict is Verdict.CORRUPT:  # a later write can repair it; batch_exists won't re-adopt it
            try:
                if self._remove(name) and self.events is not None:
                    self.events.removed([name[:64]])
            except OSError:
                pass
        return False

    def batch_get(self, keys: Sequence[str], into: Sequence[torch.Tensor]) -> list[bool]:
        self._check(keys, into)
        results = []
        for key, buf in zip(keys, into):
            name = key + self.suffix
            with self._lock:
                known = self._index.touch(name)
            ok = False
            if known or self._probe(name) is not None:
                try:
                    whole, sealed = self._read(name, buf)
                    ok = whole and self._verify(name, buf, sealed)
                except OSError as err:
                    self._count("errors")
                    self._oplog.error("storage.read_failed", name=name, errno=err.errno, error=str(err))
                if not ok:
                    buf.reshape(-1).view(torch.uint8).zero_()  # never leave a refused page's bytes
            with self._lock:
                if ok:
                    self._stats.hits += 1
                    if not known:
                        evicted = self._index.add(name, _nbytes(buf))
                else:
                    self._stats.misses += 1
                    if known:
                        self._index.remove(name)
            if ok and not known:
                self._evict(evicted)
            results.append(ok)
        return results

    def batch_exists(self, keys: Sequence[str]) -> int:
        check_keys(keys)
        n = 0
        for key in keys:
            name = key + self.suffix
            with self._lock:
                known = self._index.touch(name)
            if known:
                if self._present(name):
                    n += 1
                    continue
                with self._lock:
                    self._index.remove(name)
                break
            size = self._adoptable(name)
            if size is None or (self.page_nbytes is not None and size != self.page_nbytes):
                break
            with self._lock:
                evicted = self._index.add(name, size)
            self._evict(evicted)
            n += 1
        return n

    def delete(self, key: str) -> bool:
        check_keys([key])
        name = key + self.suffix
        with self._lock:
            self._index.remove(name)
        try:
            if self._foreign(name, self.page_format):  # another deployment's page: never ours to delete
                return False
            removed = self._remove(name)  # also a page another process stored that we never indexed
        except OSError as err:
            self._count("errors")
            self._oplog.error("storage.delete_failed", name=name, errno=err.errno, error=str(err))
            return False
        if removed:
            self._count("deletes")
            if self.events is not None:
                self.events.removed([key])
        return removed

    def stats(self) -> StorageStats:
        with self._lock:
            s = msgspec.structs.replace(self._stats)
            s.pages, s.bytes = len(self._index), self._index.bytes
        return s
