"""``TierAnnouncer``: turns a storage tier's writes and removals into KV events, with the tokens and
parent of each page; ``HostAnnouncer`` the same for host pages handed to storage; ``ChainOrder``
puts every page's ``BlockStored`` after its parent's.

A storage backend knows page hashes only; the writer (the offloader's storage worker, a prefill
backup) knows the pages' tokens and the page before them. The writer declares them from before
its ``batch_set`` until it is over (``with announcer.writing(hashes, tokens, parent):
store.batch_set(...)``; a writer whose work runs later on another thread makes the declaration
when it queues the work and ends it when the work is done, ``Declaration.end``); the backend calls
``stored([hash])`` for each page it actually wrote (a page already there is not announced again)
and ``removed(hashes)`` for each page it evicted or deleted, in the order it did so, from whatever
thread it runs on. A page written without a declaration is announced with no tokens and no parent.

Chain order: the announcers of one publisher share one ``ChainOrder``. A ``BlockStored`` whose
parent page is declared (about to be written) and not yet announced is held until the parent is
announced, in any medium, or its declarations end without it (the page was already there, or the
write failed); then it is published, and so are the events held on its own pages. A removal of a
page whose ``BlockStored`` is held waits behind it. When the publisher closes, what is still held
(a declaration that never ended) is published first, in arrival order, and counted
(``ChainOrder.unordered``). Holding costs a lock and a dict look-up: no announcer call waits on
another thread's write.
"""

from __future__ import annotations

import itertools
import threading
import weakref
from collections.abc import Sequence

from transfer.kv_events.wire import CPU_PINNED, DISK, EXTERNAL, MEDIA
from transfer.log import get_logger

log = get_logger(__name__)

# The medium each backend's pages live in (class name -> SGLang StorageMedium value).
TIER_MEDIUM = {"FileStorage": DISK, "RedisStorage": EXTERNAL, "RedisClusterStorage": EXTERNAL,
               "MooncakeStorage": EXTERNAL, "MemoryStorage": EXTERNAL}


def medium_of(store) -> str:
    """The medium of ``store``'s pages: DISK for the file tier, EXTERNAL for shared or remote
    tiers (and the in-process memory tier, which stands in for one)."""
    return TIER_MEDIUM.get(type(store).__name__, EXTERNAL)


class _Held:
    """An event the gate holds: ``deps`` things it still waits for (its parent's announcement,
    earlier held events on the same page and medium), ``followers`` the events that wait on it."""

    __slots__ = ("arrival", "event", "deps", "followers")

    def __init__(self, arrival: int, event: tuple) -> None:
        self.arrival, self.event, self.deps, self.followers = arrival, event, 0, []


class ChainOrder:
    """The chain-order gate of one publisher (``ChainOrder.of(publisher)``; see the module).

    Events are ``("stored", medium, pages, tokens, block_size, parent)`` or
    ``("removed", medium, pages)``. One is published at once unless it must wait for its parent
    (declared and not yet announced) or for an earlier held event on one of its pages in the same
    medium (so each page's stored / removed sequence per medium keeps its order). ``held``: events
    waiting now; ``unordered``: events published at the publisher's close while still waiting."""

    _gates: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
    _gates_lock = threading.Lock()

    @classmethod
    def of(cls, publisher) -> "ChainOrder":
        """The gate shared by every announcer of ``publisher`` (made on first use; it hands over
        what it holds when the publisher closes, through ``publisher.add_close_hook`` if it has one)."""
        with cls._gates_lock:
            gate = cls._gates.get(publisher)
            if gate is None:
                gate = cls._gates[publisher] = cls(publisher)
                hook = getattr(publisher, "add_close_hook", None)
                if hook is not None:
                    hook(gate.release_all)
            return gate

    def __init__(self, publisher) -> None:
        self.publisher = publisher
        self._lock = threading.Lock()
        self._pending: dict[str, int] = {}       # page -> open declarations + held BlockStored naming it
        self._waiting: dict[str, list] = {}      # page -> held events whose parent it is
        self._last: dict[tuple[str, str], _Held] = {}   # (medium, page) -> the latest held event on it
        self._held: dict[int, _Held] = {}        # arrival -> held event
        self._arrival = itertools.count()
        self._closed = False
        self.unordered = 0

    @property
    def held(self) -> int:
        return len(self._held)

    # -- declarations --------------------------------------------------------------------------
    def expect(self, page_hashes: Sequence[str]) -> None:
        """Pages about to be written: a child announced meanwhile waits for them."""
        with self._lock:
            pending = self._pending
            for h in page_hashes:
                pending[h] = pending.get(h, 0) + 1

    def settle(self, page_hashes: Sequence[str]) -> None:
        """The end of an ``expect``: pages not announced by now release what waits on them."""
        with self._lock:
            ready = []
            pending = self._pending
            for h in page_hashes:
                n = pending.get(h)
                if n is None:          # announced already
                    continue
                if n > 1:
                    pending[h] = n - 1
                else:
                    del pending[h]
                    self._parent_done(h, ready)
            self._run(ready)

    # -- events ----------------------------------------------------------------------------------
    def stored(self, medium: str, page_hashes: Sequence[str], tokens, block_size: int, parent: str | None) -> None:
        with self._lock:
            self._offer(("stored", medium, list(page_hashes), list(tokens), block_size, parent))

    def removed(self, medium: str, page_hashes: Sequence[str]) -> None:
        with self._lock:
            self._offer(("removed", medium, list(page_hashes)))

    def release_all(self) -> None:
        """Publish everything held, in arrival order, each counted in ``unordered``; from now on
        nothing is held (the publisher's close hook)."""
        with self._lock:
            self._closed = True
            held = [self._held[k] for k in sorted(self._held)]
            self._held.clear()
            self._waiting.clear()
            self._pending.clear()
            self._last.clear()
            for h in held:
                self.unordered += 1
                self._emit(h.event)
        if held:
            log.warning("kv_events.published_out_of_order", events=len(held))

    # -- under the lock ----------------------------------------------------------------------------
    def _offer(self, event: tuple) -> None:
        if self._closed:
            self._emit(event)
            return
        h = _Held(next(self._arrival), event)
        medium, pages = event[1], event[2]
        parent = event[5] if event[0] == "stored" else None
        if parent is not None and parent in self._pending:
            self._waiting.setdefault(parent, []).append(h)
            h.deps += 1
        last = self._last
        for p in pages:
            before = last.get((medium, p))
            if before is not None:
                before.followers.append(h)
                h.deps += 1
        if not h.deps:
            self._run([h])
            return
        self._held[h.arrival] = h
        for p in pages:
            last[(medium, p)] = h
        if event[0] == "stored":
            pending = self._pending
            for p in pages:
                pending[p] = pending.get(p, 0) + 1

    def _parent_done(self, page: str, ready: list) -> None:
        for w in self._waiting.pop(page, ()):
            w.deps -= 1
            if not w.deps:
                ready.append(w)

    def _run(self, ready: list) -> None:
        """Publish the events in ``ready`` (no longer waiting), then those they free, in turn."""
        i = 0
        while i < len(ready):
            h = ready[i]
            i += 1
            event = h.event
            medium, pages = event[1], event[2]
            if self._held.pop(h.arrival, None) is not None:
                last = self._last
                for p in pages:
                    if last.get((medium, p)) is h:
                        del last[(medium, p)]
            self._emit(event)
            if event[0] == "stored":
                for p in pages:
                    if self._pending.pop(p, None) is not None:   # announced: its children may go
                        self._parent_done(p, ready)
            for f in h.followers:
                f.deps -= 1
                if not f.deps:
                    ready.append(f)

    def _emit(self, event: tuple) -> None:
        if event[0] == "stored":
            _, medium, pages, tokens, block_size, parent = event
            self.publisher.stored(medium, pages, tokens, block_size, parent)
        else:
            self.publisher.removed(event[1], event[2])


class Declaration:
    """Pages a writer is about to store, from when it is made until ``end`` (or the end of its
    ``with`` block), from any thread. ``end`` is idempotent."""

    def __init__(self, announcer: "TierAnnouncer", page_hashes: Sequence[str], tokens: Sequence[int],
                 parent_hash: str | None) -> None:
        ps, ctx = announcer.page_size, {}
        prev = parent_hash
        for i, h in enumerate(page_hashes):
            ctx[h] = (list(tokens[i * ps:(i + 1) * ps]), prev)
            prev = h
        self.announcer, self.pages, self._ended = announcer, list(ctx), False
        announcer._declare(ctx)

    def __enter__(self) -> "TierAnnouncer":
        return self.announcer

    def __exit__(self, *exc) -> None:
        self.end()

    def end(self) -> None:
        """The write is over: pages it did not write release what waits on them."""
        if self._ended:
            return
        self._ended = True
        self.announcer._undeclare(self.pages)


class TierAnnouncer:
    """The event hook of one storage tier (``Storage.events``).

    Args:
        publisher: a ``KVEventPublisher`` (or anything with its ``stored`` / ``removed``).
        medium: the tier's medium (``medium_of``).
        page_size: tokens per page (``block_size`` of the events).
    Raises:
        ValueError: a medium that is not one of SGLang's.
    """

    def __init__(self, publisher, medium: str, page_size: int) -> None:
        if medium not in MEDIA:
            raise ValueError(f"medium {medium!r} is not one of {MEDIA}")
        self.publisher, self.medium, self.page_size = publisher, medium, page_size
        self.chain = ChainOrder.of(publisher)
        self._context: dict[str, list] = {}   # page -> [tokens, parent, open declarations]
        self._lock = threading.Lock()

    def writing(self, page_hashes: Sequence[str], tokens: Sequence[int], parent_hash: str | None) -> Declaration:
        """Declare the tokens (``page_size`` per page) and chain parent of pages about to be
        written, from now until the returned declaration ends (a context manager)."""
        return Declaration(self, page_hashes, tokens, parent_hash)

    def _declare(self, ctx: dict) -> None:
        with self._lock:
            context = self._context
            for h, (tokens, parent) in ctx.items():
                entry = context.get(h)
                if entry is None:
                    context[h] = [tokens, parent, 1]
                else:
                    entry[2] += 1
        self.chain.expect(list(ctx))

    def _undeclare(self, pages: list[str]) -> None:
        with self._lock:
            context = self._context
            for h in pages:
                entry = context[h]
                if entry[2] > 1:
                    entry[2] -= 1
                else:
                    del context[h]
        self.chain.settle(pages)

    def stored(self, page_hashes: Sequence[str]) -> None:
        """The backend wrote these pages (new to the tier)."""
        for h in page_hashes:
            with self._lock:
                tokens, parent, _ = self._context.get(h, ((), None, 0))
            self.chain.stored(self.medium, [h], tokens, self.page_size, parent)

    def removed(self, page_hashes: Sequence[str]) -> None:
        """The backend evicted or deleted these pages."""
        self.chain.removed(self.medium, list(page_hashes))


class HostAnnouncer:
    """The event hook of a host pool (``HostOffloader.events``): pages holding a landed chunk
    are announced ``CPU_PINNED`` when handed to storage, and removed when the pages are freed."""

    def __init__(self, publisher, page_size: int) -> None:
        self.publisher, self.page_size = publisher, page_size
        self.chain = ChainOrder.of(publisher)

    def stored(self, page_hashes: Sequence[str], tokens: Sequence[int], parent_hash: str | None) -> None:
        self.chain.stored(CPU_PINNED, list(page_hashes), tokens, self.page_size, parent_hash)

    def removed(self, page_hashes: Sequence[str]) -> None:
        self.chain.removed(CPU_PINNED, list(page_hashes))
