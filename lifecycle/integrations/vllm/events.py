"""vLLM's KV events for the pages this node stores and its tier removes (``take_events``).

The worker of TP rank 0 hooks its storage tier (``transfer.kv_events.TierAnnouncer``, which keeps
a chain's pages in order: a page is announced after its parent) with an ``EventCollector``; what it
collects rides to the scheduler in ``jobs.Report.events``, and ``EventLog.take`` turns it into
vLLM's ``BlockStored`` (block hashes = our 32-byte chain names, the parent's, the page's token ids,
``block_size``, medium ``STORAGE`` — ``CPU`` for the in-process memory tier) and ``BlockRemoved``
(pages the tier evicted or deleted). Only rank 0 reports: every rank stores the same names.
"""

from __future__ import annotations

import threading

MEDIUM_CPU, MEDIUM_STORAGE = "CPU", "STORAGE"


def vllm_medium(storage) -> str:
    return MEDIUM_CPU if type(storage).__name__ == "MemoryStorage" else MEDIUM_STORAGE


class EventCollector:
    """A ``KVEventPublisher`` stand-in for ``TierAnnouncer``: keeps the events (thread-safe; the
    tier's writes run on storage threads) as ``["stored", medium, pages, tokens, block_size, parent]``
    / ``["removed", medium, pages]`` lists until ``take``."""

    def __init__(self, medium: str) -> None:
        self.medium = medium
        self._events: list = []
        self._lock = threading.Lock()

    def stored(self, medium, page_hashes, token_ids, block_size, parent=None) -> None:
        with self._lock:
            self._events.append(["stored", self.medium, list(page_hashes), list(token_ids), block_size, parent])

    def removed(self, medium, page_hashes) -> None:
        with self._lock:
            self._events.append(["removed", self.medium, list(page_hashes)])

    def take(self) -> list:
        with self._lock:
            out, self._events = self._events, []
        return out


def attach(storage, page_size: int) -> EventCollector:
    """Hook ``storage`` (its ``events``) with a collector; returns it."""
    from transfer.kv_events.announcer import TierAnnouncer, medium_of

    collector = EventCollector(vllm_medium(storage))
    storage.events = TierAnnouncer(collector, medium_of(storage), page_size)
    return collector


def _hash(name: str):
    try:
        return bytes.fromhex(name)
    except ValueError:
        return name.encode()


class EventLog:
    """The scheduler side's events, from the workers' reports, until ``take_events``."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._events: list = []
        self.stored_pages = 0
        self.removed_pages = 0

    def add(self, events: list) -> None:
        self._events.extend(events)

    def take(self, store=None) -> list:
        """vLLM ``KVCacheEvent``s since the last call."""
        from vllm.distributed.kv_events import BlockRemoved, BlockStored  # noqa: PLC0415

        events, self._events = self._events, []
        out = []
        for e in events:
            if e[0] == "stored":
                _, medium, pages, tokens, block_size, parent = e
                self.stored_pages += len(pages)
                out.append(BlockStored(block_hashes=[_hash(p) for p in pages],
                                       parent_block_hash=None if parent is None else _hash(parent),
                                       token_ids=list(tokens), block_size=block_size, lora_id=None,
                                       medium=medium, lora_name=None))
            else:
                self.removed_pages += len(e[2])
                out.append(BlockRemoved(block_hashes=[_hash(p) for p in e[2]], medium=e[1]))
        return out


__all__ = ["EventCollector", "EventLog", "attach", "vllm_medium"]
