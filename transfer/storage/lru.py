"""Least-recently-used index of stored pages with optional byte and page capacity bounds."""

from __future__ import annotations

from collections import OrderedDict


class LruIndex:
    """Names -> byte sizes, oldest first.

    Args:
        capacity_bytes: evict beyond this many bytes (None: unbounded).
        capacity_pages: evict beyond this many pages (None: unbounded).
    """

    def __init__(self, capacity_bytes: int | None = None, capacity_pages: int | None = None) -> None:
        for what, cap in (("capacity_bytes", capacity_bytes), ("capacity_pages", capacity_pages)):
            if cap is not None and cap < 1:
                raise ValueError(f"{what} must be >= 1 or None, got {cap}")
        self.capacity_bytes, self.capacity_pages = capacity_bytes, capacity_pages
        self._sizes: OrderedDict[str, int] = OrderedDict()
        self.bytes = 0

    def __contains__(self, name: str) -> bool:
        return name in self._sizes

    def __len__(self) -> int:
        return len(self._sizes)

    def touch(self, name: str) -> bool:
        """Mark ``name`` most recently used. Returns whether it is present."""
        if name not in self._sizes:
            return False
        self._sizes.move_to_end(name)
        return True

    def add(self, name: str, nbytes: int) -> list[str]:
        """Insert (or refresh) ``name`` as most recent; evict the oldest others beyond capacity.

        Returns:
            The evicted names (the caller removes their data).
        """
        self.remove(name)
        self._sizes[name] = nbytes
        self.bytes += nbytes
        evicted = []
        while len(self._sizes) > 1 and self._over():
            old, size = self._sizes.popitem(last=False)
            self.bytes -= size
            evicted.append(old)
        return evicted

    def remove(self, name: str) -> bool:
        """Drop ``name``. Returns whether it was present."""
        size = self._sizes.pop(name, None)
        if size is None:
            return False
        self.bytes -= size
        return True

    def _over(self) -> bool:
        return (self.capacity_bytes is not None and self.bytes > self.capacity_bytes) or (
            self.capacity_pages is not None and len(self._sizes) > self.capacity_pages
        )
