"""Zero-copy buffers for the Mooncake client: big storages kept registered (bounded, LRU), lone
tensors registered per call.

Mooncake moves bytes straight between registered memory and the store (RDMA needs the memory
registered; TCP copies from it). A page handed to ``MooncakeStorage`` is a view into the memory
of a tensor storage. A storage of at least ``pool_min_bytes`` (the host pool, whose
``page_bytes(p)`` views all share one storage) is registered the first time one of its pages is
seen and stays registered — and referenced, so it cannot be freed under the client — while it is
among the ``max_kept`` most recently used such storages. Beyond that the least recently used one
that no call is using is unregistered and its reference dropped, so a caller handing fresh big
tensors on every call (each a new storage) neither pins them all in memory nor grows the client's
registrations: what stays registered is bounded. The host pool, used by every call, stays kept.
A smaller storage (a lone page tensor, the per-call seal buffer) is registered for one call only.

Why an LRU and not a registered staging buffer (every foreign tensor copied through it): measured
in ``bench/bench_mooncake_registrations.py`` (docs/benchmarks.md) — see there for the figures.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterable
from contextlib import contextmanager

import torch

from transfer.errors import StorageError

#: Big storages kept registered at most (beyond: the least recently used idle one is dropped).
DEFAULT_MAX_KEPT = 4


class _Kept:
    __slots__ = ("size", "storage", "pins")

    def __init__(self, size: int, storage: torch.UntypedStorage) -> None:
        self.size, self.storage, self.pins = size, storage, 0


class BufferRegistry:
    """Registers tensor memory with one Mooncake client (thread-safe).

    Args:
        store: a set-up ``MooncakeDistributedStore``.
        pool_min_bytes: storages at least this big are kept registered (up to ``max_kept``).
        max_kept: how many such storages stay registered when no call uses them (>= 1; None:
            unbounded, every big storage kept until ``close``).
    """

    def __init__(self, store, pool_min_bytes: int = 1 << 20, max_kept: int | None = DEFAULT_MAX_KEPT) -> None:
        if max_kept is not None and max_kept < 1:
            raise ValueError(f"max_kept must be >= 1 or None, got {max_kept}")
        self._store = store
        self.pool_min_bytes, self.max_kept = pool_min_bytes, max_kept
        self._lock = threading.Lock()
        self._pools: OrderedDict[int, _Kept] = OrderedDict()  # base ptr -> kept storage, LRU first
        self.registrations = 0
        self.unregistrations = 0

    @property
    def kept(self) -> int:
        """How many big storages are registered (and referenced) now."""
        with self._lock:
            return len(self._pools)

    @property
    def kept_bytes(self) -> int:
        """Bytes of the big storages registered now."""
        with self._lock:
            return sum(k.size for k in self._pools.values())

    def _register(self, ptr: int, nbytes: int) -> None:
        rc = self._store.register_buffer(ptr, nbytes)
        if rc != 0:
            raise StorageError(f"mooncake could not register {nbytes} bytes of host memory (code {rc})")
        self.registrations += 1

    def _unregister(self, ptr: int) -> None:
        try:
            self._store.unregister_buffer(ptr)
        except Exception:  # noqa: BLE001 - the client may already be closed
            pass
        self.unregistrations += 1

    def _covering(self, ptr: int, nbytes: int) -> int | None:
        for base, kept in self._pools.items():
            if base <= ptr and ptr + nbytes <= base + kept.size:
                return base
        return None

    def _trim(self) -> list[int]:
        """Under the lock: drop idle least-recently-used entries beyond ``max_kept``; their bases."""
        if self.max_kept is None:
            return []
        dropped = []
        excess = len(self._pools) - self.max_kept
        for base in list(self._pools):
            if excess <= 0:
                break
            if self._pools[base].pins == 0:
                del self._pools[base]
                dropped.append(base)
                excess -= 1
        return dropped

    @contextmanager
    def registered(self, tensors: Iterable[torch.Tensor]):
        """Within the block, the memory of every tensor is registered (big storages kept, up to
        ``max_kept`` idle ones; others dropped after the block).

        Raises:
            StorageError: Mooncake refused a registration (nothing stays registered for this call).
        """
        temporary: list[int] = []
        pinned: list[int] = []
        try:
            for t in tensors:
                ptr, nbytes = t.data_ptr(), t.numel() * t.element_size()
                storage = t.untyped_storage()
                base, size = storage.data_ptr(), storage.nbytes()
                with self._lock:
                    if ptr in temporary:
                        continue
                    hit = self._covering(ptr, nbytes)
                    if hit is not None:
                        self._pools.move_to_end(hit)
                        self._pools[hit].pins += 1
                        pinned.append(hit)
                        continue
                    if size >= self.pool_min_bytes:
                        self._register(base, size)
                        kept = self._pools[base] = _Kept(size, storage)
                        kept.pins += 1
                        pinned.append(base)
                        continue
                self._register(ptr, nbytes)
                temporary.append(ptr)
            yield
        finally:
            for ptr in temporary:
                self._unregister(ptr)
            with self._lock:
                for base in pinned:
                    kept = self._pools.get(base)
                    if kept is not None:
                        kept.pins -= 1
                dropped = self._trim()
            for base in dropped:
                self._unregister(base)

    def close(self) -> None:
        """Unregister the kept storages and drop their references. Idempotent."""
        with self._lock:
            pools, self._pools = self._pools, OrderedDict()
        for base in pools:
            self._unregister(base)
