"""``NodeStats``: one decode node's numbers in one msgspec struct — the manager, the offloader, the
storage tier and the prefix loader — taken together, JSON-serialisable (``to_json``). The same
struct feeds the Prometheus metrics (``lifecycle.metrics``), ``kv-lifecycle simulate``'s report and
its ``--json``. Fields are documented field by field in docs/metrics.md.
"""

from __future__ import annotations

import msgspec

from lifecycle.records import Stats
from transfer.host_offloader import OffloaderStats
from transfer.prefix import PrefixStats
from transfer.storage.base import StorageStats
from transfer.storage.breaker import BreakerStats

# Tier names by backend class (the ``tier`` label of the metrics).
TIER_NAMES = {"FileStorage": "file", "MemoryStorage": "memory", "RedisStorage": "redis",
              "RedisClusterStorage": "redis_cluster", "MooncakeStorage": "mooncake"}


class TierStats(msgspec.Struct):
    """One storage tier: ``tier`` its kind (``file``, ``memory``, ``redis``, ``redis_cluster``,
    ``mooncake``; otherwise the backend's class name), ``storage`` its counters (the backend's
    ``StorageStats``, with the backend's extra fields), ``breaker`` its circuit breaker (None: the
    tier has none, e.g. the in-process memory tier asked directly)."""

    tier: str
    storage: StorageStats
    breaker: BreakerStats | None = None


class NodeStats(msgspec.Struct):
    """Everything one node counts. ``page_nbytes``: bytes of one host page (0 when unknown), so
    ``manager.pages_enqueued * page_nbytes`` is the bytes offloaded. ``refusals``: the manager's
    refused calls by ``"TRIGGER in STATE"`` (``mgr.refusals()``). Parts a node does not have are
    None (a manager over an offloader that is not a ``HostOffloader``, no prefix loader)."""

    manager: Stats
    offloader: OffloaderStats | None = None
    tiers: list[TierStats] = msgspec.field(default_factory=list)
    prefix: PrefixStats | None = None
    page_nbytes: int = 0
    refusals: dict[str, int] = msgspec.field(default_factory=dict)

    def to_json(self) -> bytes:
        """The struct as JSON (``msgspec.json``)."""
        return msgspec.json.encode(self)

    def to_builtins(self) -> dict:
        """The struct as plain dicts, lists and numbers (for ``json.dump``)."""
        return msgspec.to_builtins(self)


def tier_name(store) -> str:
    """The ``tier`` name of a storage backend."""
    return TIER_NAMES.get(type(store).__name__, type(store).__name__)


def collect(manager, *, offloader=None, storage=None, prefix_loader=None, page_nbytes: int = 0) -> NodeStats:
    """Take every part's counters now (each part's own ``stats()``; call from the scheduler thread).

    Args:
        manager: a ``DecodeOffloadManager``.
        offloader: default ``manager.offloader`` when it has ``stats()``.
        storage: one backend or a list of them (default: the offloader's ``storage``).
        prefix_loader: a ``PrefixLoader`` (None: no prefix section).
        page_nbytes: bytes of a host page (default: the offloader's host pool's, else 0).
    Returns:
        A ``NodeStats``.
    """
    offloader = offloader if offloader is not None else getattr(manager, "offloader", None)
    off_stats = _call(offloader)
    if not isinstance(off_stats, OffloaderStats):
        off_stats = None
    if storage is None:
        storage = getattr(offloader, "storage", None)
    stores = [] if storage is None else (list(storage) if isinstance(storage, (list, tuple)) else [storage])
    breaker = getattr(prefix_loader, "breaker", None)
    tiers = []
    for store in stores:
        b = getattr(store, "breaker", None) or breaker
        tiers.append(TierStats(tier_name(store), store.stats(), None if b is None else b.stats()))
    if not page_nbytes:
        page_nbytes = getattr(getattr(offloader, "host", None), "page_nbytes", 0) or 0
    refusals = getattr(manager, "refusals", None)
    return NodeStats(manager.stats(), off_stats, tiers, None if prefix_loader is None else prefix_loader.stats(),
                     page_nbytes, refusals() if callable(refusals) else {})


def from_stack(manager, stack) -> NodeStats:
    """``collect`` over a ``transfer.build_stack`` stack and its manager."""
    return collect(manager, offloader=stack.offloader, storage=stack.storage, prefix_loader=stack.prefix_loader,
                   page_nbytes=stack.host_pool.page_nbytes)


def _call(offloader):
    stats = getattr(offloader, "stats", None)
    return stats() if callable(stats) else None
