"""Build a whole transfer stack (pools, storage, offloader, prefix loader) from a model shape."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

import hashing
from transfer.allocator import PagedTokenAllocator
from transfer.host_offloader import HostOffloader
from transfer.host_pool import HostPool
from transfer.kv_pool import KVPool
from transfer.prefix import PrefixLoader
from transfer.req_pool import ReqToTokenPool
from transfer.storage.base import Storage
from transfer.storage.file import FileStorage
from transfer.storage.memory import MemoryStorage
from transfer.storage.spec import is_redis_spec, open_storage


@dataclass
class TransferStack:
    """Every part of one decode node's transfer mechanism."""

    kv_pool: KVPool
    allocator: PagedTokenAllocator
    req_to_token_pool: ReqToTokenPool
    host_pool: HostPool
    storage: Storage
    offloader: HostOffloader
    prefix_loader: PrefixLoader

    def close(self) -> None:
        """Drain and stop the workers, then release the storage backend."""
        self.offloader.close()
        self.prefix_loader.close()
        self.storage.close()


def build_stack(
    layers: int,
    heads: int,
    head_dim: int,
    dtype: torch.dtype,
    page_size: int,
    device_tokens: int,
    host_tokens: int,
    rows: int,
    max_len: int,
    storage: str | Storage = "memory",
    device: str = "cpu",
    mla: bool = False,
    model_name: str = "model",
    tp_rank: int = 0,
    tp_size: int = 1,
    storage_capacity_bytes: int | None = None,
    storage_ttl_s: float | None = None,
) -> TransferStack:
    """Build a stack.

    Args:
        layers, heads, head_dim, dtype: model KV shape (MLA: heads = 1, head_dim = latent width).
        page_size: tokens per page.
        device_tokens: allocatable device slots (the pool gets ``page_size`` more for padding).
        host_tokens: host pool capacity in tokens.
        rows, max_len: req-to-token pool shape.
        storage: "memory", "file:DIR", "redis://HOST:PORT/DB" (Redis or Valkey), or a ready ``Storage``.
        device: "cpu" or "cuda".
        mla: latent-only KV.
        model_name, tp_rank, tp_size: name pages as SGLang does (``hashing.storage_suffix``).
        storage_capacity_bytes: LRU bound for a built backend.
        storage_ttl_s: page expiry for a Redis backend (None: never).
    Raises:
        ValueError: bad sizes or an unknown storage spec. StorageUnavailable: unwritable dir, or
        an unreachable Redis server.
    """
    kv = KVPool(layers, heads, head_dim, dtype, device_tokens + page_size, device=device, mla=mla)
    host = HostPool(layers, heads, head_dim, dtype, page_size, host_tokens, mla=mla)
    if isinstance(storage, Storage):
        store = storage
    else:
        suffix = hashing.storage_suffix(model_name, tp_rank, tp_size, is_mla=mla)
        if storage == "memory":
            store = MemoryStorage(suffix, host.page_nbytes, storage_capacity_bytes)
        elif isinstance(storage, str) and storage.startswith("file:") and len(storage) > 5:
            store = FileStorage(os.path.expanduser(storage[5:]), suffix, host.page_nbytes,
                                storage_capacity_bytes)
        elif is_redis_spec(storage):
            store = open_storage(storage, suffix, host.page_nbytes, capacity_bytes=storage_capacity_bytes,
                                 ttl_s=storage_ttl_s, page_dtype=dtype,
                                 page_shape=tuple(host.buffer.shape[1:]))
        else:
            raise ValueError(
                f"storage must be 'memory', 'file:DIR', 'redis://HOST:PORT/DB' or a Storage, got {storage!r}")
    allocator = PagedTokenAllocator(device_tokens, page_size)
    return TransferStack(
        kv_pool=kv,
        allocator=allocator,
        req_to_token_pool=ReqToTokenPool(rows, max_len, device=device),
        host_pool=host,
        storage=store,
        offloader=HostOffloader(kv, host, store),
        prefix_loader=PrefixLoader(kv, allocator, host, store),
    )
