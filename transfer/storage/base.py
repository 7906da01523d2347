"""The storage interface: batch operations on whole KV pages named by page hash.

A backend stores page ``key`` under the name ``{key}{suffix}`` (SGLang HiCacheFile naming; the
suffix comes from ``hashing.storage_suffix``). ``IndexedStorage`` implements the shared behaviour
(skip existing keys, LRU eviction under a capacity bound, stats, failure accounting) over three
primitives a backend provides; it is safe to call from several threads, and holds its lock only
for index updates, never during I/O.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Sequence

import msgspec
from transfer.log import get_logger
import torch

from transfer.errors import PageSizeMismatch
from transfer.storage.lru import LruIndex

log = get_logger(__name__)


class StorageStats(msgspec.Struct):
    """Counters of one storage backend since construction (``pages``/``bytes``: current contents)."""

    pages: int = 0
    bytes: int = 0
    stored: int = 0
    skipped: int = 0
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    deletes: int = 0
    errors: int = 0


class Storage(ABC):
    """Batch page storage.

    Pages are contiguous CPU tensors whose raw bytes are stored verbatim (no header).
    """

    suffix: str
    page_nbytes: int | None

    @abstractmethod
    def batch_set(self, keys: Sequence[str], pages: Sequence[torch.Tensor]) -> list[bool]:
        """Store ``pages[i]`` under ``keys[i]``; a key already stored is skipped (and is a success).

        Returns:
            Per key, whether the page is stored afterwards. Pages are independent: a failed page
            does not stop the others (a backend may write them concurrently); each failure is
            counted and logged.
        Raises:
            ValueError: ``len(keys) != len(pages)``. PageSizeMismatch: a page of the wrong size.
            Both are raised before anything is written.
        """

    @abstractmethod
    def batch_get(self, keys: Sequence[str], into: Sequence[torch.Tensor]) -> list[bool]:
        """Read page ``keys[i]`` into the contiguous CPU tensor ``into[i]``.

        Returns:
            Per key, whether it was found and read in full.
        Raises:
            ValueError / PageSizeMismatch: as ``batch_set``, before anything is read.
        """

    @abstractmethod
    def batch_exists(self, keys: Sequence[str]) -> int:
        """The length of the longest prefix of ``keys`` that is stored."""

    @abstractmethod
    def delete(self, key: str) -> bool:
        """Remove ``key``. Returns whether it was stored."""

    @abstractmethod
    def stats(self) -> StorageStats:
        """A snapshot of the counters."""

    def close(self) -> None:
        """Release resources (default: nothing)."""


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def check_batch(keys: Sequence[str], pages: Sequence[torch.Tensor], page_nbytes: int | None) -> None:
    """The arguments of a batch call, checked before anything is read or written.

    Raises:
        ValueError: lengths differ, an empty or non-str key, a page not a contiguous CPU tensor.
        PageSizeMismatch: a page of another size than ``page_nbytes`` (when set).
    """
    if len(keys) != len(pages):
        raise ValueError(f"{len(keys)} keys for {len(pages)} pages")
    for key, page in zip(keys, pages):
        if not isinstance(key, str) or not key:
            raise ValueError(f"keys must be non-empty str, got {key!r}")
        if not page.is_contiguous() or page.device.type != "cpu":
            raise ValueError("pages must be contiguous CPU tensors")
        if page_nbytes is not None and _nbytes(page) != page_nbytes:
            raise PageSizeMismatch(f"page of {_nbytes(page)} bytes, expected {page_nbytes}")


class IndexedStorage(Storage):
    """Shared behaviour over ``_write`` / ``_read`` / ``_remove`` primitives.

    Args:
        suffix: appended to every key to form a page's name.
        page_nbytes: required page size in bytes (None: any size).
        capacity_bytes / capacity_pages: LRU eviction bounds (None: unbounded).
    """

    def __init__(
        self,
        suffix: str = "",
        page_nbytes: int | None = None,
        capacity_bytes: int | None = None,
        capacity_pages: int | None = None,
    ) -> None:
        self.suffix, self.page_nbytes = suffix, page_nbytes
        self._index = LruIndex(capacity_bytes, capacity_pages)
        self._lock = threading.Lock()
        self._stats = StorageStats()

    # -- primitives ---------------------------------------------------------------------------
    @abstractmethod
    def _write(self, name: str, page: torch.Tensor) -> None:
        """Store ``page`` under ``name`` atomically. Raises OSError on failure."""

    @abstractmethod
    def _read(self, name: str, into: torch.Tensor) -> bool:
        """Fill ``into`` from ``name``; False if absent or short. Raises OSError on I/O failure."""

    @abstractmethod
    def _remove(self, name: str) -> None:
        """Delete ``name`` if present."""

    def _probe(self, name: str) -> int | None:
        """Size of ``name`` if stored by someone else since the index was built (default: None)."""
        return None

    def _present(self, name: str) -> bool:
        """Whether indexed ``name`` is still stored (a backend whose data can vanish behind the
        index checks; default: True). False drops it from the index."""
        return True

    # -- behaviour ----------------------------------------------------------------------------
    def _check(self, keys: Sequence[str], pages: Sequence[torch.Tensor]) -> None:
        check_batch(keys, pages, self.page_nbytes)

    def _evict(self, names: list[str]) -> None:
        for name in names:
            try:
                self._remove(name)
            except OSError as err:
                log.warning("storage.evict_failed", name=name, error=str(err))
        with self._lock:
            self._stats.evictions += len(names)

    def batch_set(self, keys: Sequence[str], pages: Sequence[torch.Tensor]) -> list[bool]:
        self._check(keys, pages)
        results = [False] * len(keys)
        todo = []
        for i, (key, page) in enumerate(zip(keys, pages)):
            name = key + self.suffix
            with self._lock:
                if self._index.touch(name):
                    self._stats.skipped += 1
                    results[i] = True
                    continue
            todo.append((i, name, page))
        for (i, name, page), err in zip(todo, self._write_many([(n, p) for _, n, p in todo])):
            if err is not None:
                with self._lock:
                    self._stats.errors += 1
                log.error("storage.write_failed", name=name, errno=err.errno, error=str(err))
                continue
            with self._lock:
                evicted = self._index.add(name, _nbytes(page))
                self._stats.stored += 1
            self._evict(evicted)
            results[i] = True
        return results

    def _write_many(self, items: list[tuple[str, torch.Tensor]]) -> list[OSError | None]:
        """Write each ``(name, page)``; per item, the OSError it failed with or None.
        Default: one after the other; a backend may write them concurrently."""
        errors: list[OSError | None] = []
        for name, page in items:
            try:
                self._write(name, page)
                errors.append(None)
            except OSError as err:
                errors.append(err)
        return errors

    def batch_get(self, keys: Sequence[str], into: Sequence[torch.Tensor]) -> list[bool]:
        self._check(keys, into)
        results = []
        for key, buf in zip(keys, into):
            name = key + self.suffix
            with self._lock:
                known = self._index.touch(name)
            ok = False
            if known:
                try:
                    ok = self._read(name, buf)
                except OSError as err:
                    with self._lock:
                        self._stats.errors += 1
                    log.error("storage.read_failed", name=name, errno=err.errno, error=str(err))
            with self._lock:
                if known and not ok:
                    self._index.remove(name)
                if ok:
                    self._stats.hits += 1
                else:
                    self._stats.misses += 1
            results.append(ok)
        return results

    def batch_exists(self, keys: Sequence[str]) -> int:
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
            size = self._probe(name)
            if size is None or (self.page_nbytes is not None and size != self.page_nbytes):
                break
            with self._lock:
                evicted = self._index.add(name, size)
            self._evict(evicted)
            n += 1
        return n

    def delete(self, key: str) -> bool:
        name = key + self.suffix
        with self._lock:
            present = self._index.remove(name)
            if present:
                self._stats.deletes += 1
        if present:
            self._remove(name)
        return present

    def stats(self) -> StorageStats:
        with self._lock:
            s = msgspec.structs.replace(self._stats)
            s.pages, s.bytes = len(self._index), self._index.bytes
        return s
