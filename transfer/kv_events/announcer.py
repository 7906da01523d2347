"""``TierAnnouncer``: turns a storage tier's writes and removals into KV events, with the tokens and
parent of each page.

A storage backend knows page hashes only; the writer (the offloader's storage worker, a prefill
backup) knows the pages' tokens and the page before them. The writer declares them for the length
of its ``batch_set`` (``with announcer.writing(hashes, tokens, parent): store.batch_set(...)``);
the backend calls ``stored([hash])`` for each page it actually wrote (a page already there is not
announced again) and ``removed(hashes)`` for each page it evicted or deleted, in the order it did
so, from whatever thread it runs on. A page written without a declaration is announced with no
tokens and no parent.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from contextlib import contextmanager

from transfer.kv_events.wire import CPU_PINNED, DISK, EXTERNAL

# The medium each backend's pages live in (class name -> SGLang StorageMedium value).
TIER_MEDIUM = {"FileStorage": DISK, "RedisStorage": EXTERNAL, "RedisClusterStorage": EXTERNAL,
               "MooncakeStorage": EXTERNAL, "MemoryStorage": EXTERNAL}


def medium_of(store) -> str:
    """The medium of ``store``'s pages: DISK for the file tier, EXTERNAL for shared or remote
    tiers (and the in-process memory tier, which stands in for one)."""
    return TIER_MEDIUM.get(type(store).__name__, EXTERNAL)


class TierAnnouncer:
    """The event hook of one storage tier (``Storage.events``).

    Args:
        publisher: a ``KVEventPublisher`` (or anything with its ``stored`` / ``removed``).
        medium: the tier's medium (``medium_of``).
        page_size: tokens per page (``block_size`` of the events).
    """

    def __init__(self, publisher, medium: str, page_size: int) -> None:
        self.publisher, self.medium, self.page_size = publisher, medium, page_size
        self._context: dict[str, tuple[list[int], str | None]] = {}
        self._lock = threading.Lock()

    @contextmanager
    def writing(self, page_hashes: Sequence[str], tokens: Sequence[int], parent_hash: str | None):
        """Declare the tokens (``page_size`` per page) and chain parent of pages about to be written."""
        ps, ctx = self.page_size, {}
        prev = parent_hash
        for i, h in enumerate(page_hashes):
            ctx[h] = (list(tokens[i * ps:(i + 1) * ps]), prev)
            prev = h
        with self._lock:
            self._context.update(ctx)
        try:
            yield self
        finally:
            with self._lock:
                for h in ctx:
                    self._context.pop(h, None)

    def stored(self, page_hashes: Sequence[str]) -> None:
        """The backend wrote these pages (new to the tier)."""
        for h in page_hashes:
            with self._lock:
                tokens, parent = self._context.get(h, ((), None))
            self.publisher.stored(self.medium, [h], tokens, self.page_size, parent)

    def removed(self, page_hashes: Sequence[str]) -> None:
        """The backend evicted or deleted these pages."""
        self.publisher.removed(self.medium, list(page_hashes))


class HostAnnouncer:
    """The event hook of a host pool (``HostOffloader.events``): pages holding a landed chunk
    are announced ``CPU_PINNED`` when handed to storage, and removed when the pages are freed."""

    def __init__(self, publisher, page_size: int) -> None:
        self.publisher, self.page_size = publisher, page_size

    def stored(self, page_hashes: Sequence[str], tokens: Sequence[int], parent_hash: str | None) -> None:
        self.publisher.stored(CPU_PINNED, list(page_hashes), tokens, self.page_size, parent_hash)

    def removed(self, page_hashes: Sequence[str]) -> None:
        self.publisher.removed(CPU_PINNED, list(page_hashes))
