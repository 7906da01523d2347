"""Zero-copy buffers for the Mooncake client: a host pool is registered once, lone tensors per call.

Mooncake moves bytes straight between registered memory and the store (RDMA needs the memory
registered; TCP copies from it). A page handed to ``MooncakeStorage`` is a view into the memory
of a tensor storage. When that storage is bigger than ``pool_min_bytes`` (the host pool, whose
``page_bytes(p)`` views all share one storage) it is registered the first time one of its pages
is seen and stays registered — and referenced, so it cannot be freed under the client — until
``close``. A smaller storage (a lone page tensor, the per-call seal buffer) is registered for the
duration of one call only.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from contextlib import contextmanager

import torch

from transfer.errors import StorageError


class BufferRegistry:
    """Registers tensor memory with one Mooncake client (thread-safe).

    Args:
        store: a set-up ``MooncakeDistributedStore``.
        pool_min_bytes: storages at least this big are registered once and kept.
    """

    def __init__(self, store, pool_min_bytes: int = 1 << 20) -> None:
        self._store = store
        self.pool_min_bytes = pool_min_bytes
        self._lock = threading.Lock()
        self._pools: dict[int, tuple[int, torch.UntypedStorage]] = {}  # base ptr -> (nbytes, storage)
        self.registrations = 0

    def _register(self, ptr: int, nbytes: int) -> None:
        rc = self._store.register_buffer(ptr, nbytes)
        if rc != 0:
            raise StorageError(f"mooncake could not register {nbytes} bytes of host memory (code {rc})")
        self.registrations += 1

    def _covered(self, ptr: int, nbytes: int) -> bool:
        for base, (size, _) in self._pools.items():
            if base <= ptr and ptr + nbytes <= base + size:
                return True
        return False

    @contextmanager
    def registered(self, tensors: Iterable[torch.Tensor]):
        """Within the block, the memory of every tensor is registered (pools kept, others dropped after).

        Raises:
            StorageError: Mooncake refused a registration (nothing stays registered for this call).
        """
        temporary: list[int] = []
        try:
            for t in tensors:
                ptr, nbytes = t.data_ptr(), t.numel() * t.element_size()
                storage = t.untyped_storage()
                base, size = storage.data_ptr(), storage.nbytes()
                with self._lock:
                    if self._covered(ptr, nbytes) or ptr in temporary:
                        continue
                    if size >= self.pool_min_bytes:
                        self._register(base, size)
                        self._pools[base] = (size, storage)
                        continue
                self._register(ptr, nbytes)
                temporary.append(ptr)
            yield
        finally:
            for ptr in temporary:
                self._store.unregister_buffer(ptr)

    def close(self) -> None:
        """Unregister the kept pools and drop their references. Idempotent."""
        with self._lock:
            pools, self._pools = self._pools, {}
        for base in pools:
            try:
                self._store.unregister_buffer(base)
            except Exception:  # noqa: BLE001 - the client may already be closed
                pass
