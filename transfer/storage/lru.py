"""Least-recently-used index of stored pages with optional byte and page capacity bounds.

A store indexes one entry per stored page (hundreds of thousands on a busy node), so the index is
kept compact: a page named ``{64 lowercase hex}{suffix}`` (every page of a store: one suffix) is
keyed by its 32-byte binary digest instead of its ~75-character name, the byte sizes are shared
int objects (a store's pages have one or a few sizes), and the order lives in one insertion-ordered
``dict`` (oldest first) rather than an ``OrderedDict``'s per-entry links: about 100 bytes an entry
instead of about 230. Any other name is indexed as itself, so the index accepts every name.
"""

from __future__ import annotations

import math

_SHARED_SIZES = 64  # distinct sizes whose int objects are shared between entries


class LruIndex:
    """Names -> byte sizes, oldest first.

    Args:
        capacity_bytes: evict beyond this many bytes (None: unbounded).
        capacity_pages: evict beyond this many pages (None: unbounded).
    Raises:
        ValueError: a capacity below 1.
    """

    def __init__(self, capacity_bytes: int | None = None, capacity_pages: int | None = None) -> None:
        for what, cap in (("capacity_bytes", capacity_bytes), ("capacity_pages", capacity_pages)):
            if cap is not None and cap < 1:
                raise ValueError(f"{what} must be >= 1 or None, got {cap}")
        self.capacity_bytes, self.capacity_pages = capacity_bytes, capacity_pages
        self._sizes: dict[bytes | str, int] = {}  # insertion order = least recently used first
        self._suffix: str | None = None  # the suffix of the first page name seen
        self._size_objs: dict[int, int] = {}
        self._holes = 0  # entries removed since the dict was last compacted
        self.bytes = 0

    def __contains__(self, name: str) -> bool:
        return self._key(name) in self._sizes

    def __len__(self) -> int:
        return len(self._sizes)

    def touch(self, name: str) -> bool:
        """Mark ``name`` most recently used. Returns whether it is present."""
        key = self._key(name)
        size = self._sizes.pop(key, None)
        if size is None:
            return False
        self._sizes[key] = size
        self._holes += 1
        return True

    def add(self, name: str, nbytes: int) -> list[str]:
        """Insert (or refresh) ``name`` as most recent; evict the oldest others beyond capacity.

        Returns:
            The evicted names (the caller removes their data).
        """
        key = self._key(name)
        self._drop(key)
        nbytes = self._shared(nbytes)
        self._sizes[key] = nbytes
        self.bytes += nbytes
        if len(self._sizes) < 2 or not self._over():
            return []
        return self._evict()

    def remove(self, name: str) -> bool:
        """Drop ``name``. Returns whether it was present."""
        return self._drop(self._key(name))

    def _drop(self, key) -> bool:
        size = self._sizes.pop(key, None)
        if size is None:
            return False
        self.bytes -= size
        self._holes += 1
        return True

    def _evict(self) -> list[str]:
        """Drop the oldest entries (never the newest) until within capacity; their names."""
        self._compact_if_holey()
        pages, nbytes, victims = len(self._sizes), self.bytes, []
        for key, size in self._sizes.items():  # oldest first; stops well before the newest
            if pages < 2 or not self._over_with(nbytes, pages):
                break
            victims.append(key)
            pages, nbytes = pages - 1, nbytes - size
        for key in victims:
            self._drop(key)
        return [self._name(key) for key in victims]

    def _compact_if_holey(self) -> None:
        """Finding the oldest entry walks past the holes removals leave at the front of the dict;
        rebuilding it every ~sqrt(2n) removals keeps that walk and the rebuilds O(sqrt n) each."""
        if self._holes > max(256, math.isqrt(128 * len(self._sizes))):
            self._sizes = dict(self._sizes)
            self._holes = 0

    def _over(self) -> bool:
        return self._over_with(self.bytes, len(self._sizes))

    def _over_with(self, nbytes: int, pages: int) -> bool:
        return (self.capacity_bytes is not None and nbytes > self.capacity_bytes) or (
            self.capacity_pages is not None and pages > self.capacity_pages
        )

    def _key(self, name: str) -> bytes | str:
        """The 32-byte digest of a page name ``{64 lowercase hex}{suffix}``; any other name as
        itself (a digest and a name never compare equal, and each name has one key)."""
        suffix = self._suffix
        if suffix is None:
            if _digest(name) is None:
                return name
            self._suffix = suffix = name[64:]
        if len(name) != 64 + len(suffix) or not name.endswith(suffix):
            return name
        digest = _digest(name)
        return name if digest is None else digest

    def _name(self, key: bytes | str) -> str:
        return key.hex() + self._suffix if isinstance(key, bytes) else key

    def _shared(self, nbytes: int) -> int:
        shared = self._size_objs.get(nbytes)
        if shared is not None:
            return shared
        if len(self._size_objs) < _SHARED_SIZES:
            self._size_objs[nbytes] = nbytes
        return nbytes


def _digest(name) -> bytes | None:
    """The 32 bytes that ``name[:64]`` spells in lowercase hex; None if it spells none."""
    if not isinstance(name, str) or len(name) < 64:
        return None
    head = name[:64]
    try:
        digest = bytes.fromhex(head)
    except ValueError:
        return None
    return digest if len(digest) == 32 and digest.hex() == head else None
