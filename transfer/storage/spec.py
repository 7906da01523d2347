"""Open a storage backend from a one-line spec: ``memory``, ``file:DIR``, ``redis://host:port/db``."""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch

from transfer.storage.base import Storage

REDIS_SCHEMES = ("redis://", "rediss://", "unix://", "valkey://", "valkeys://")


def is_redis_spec(spec: str) -> bool:
    """Whether ``spec`` names a Redis/Valkey server."""
    return isinstance(spec, str) and spec.startswith(REDIS_SCHEMES)


def open_storage(
    spec: str,
    suffix: str = "",
    page_nbytes: int | None = None,
    *,
    capacity_bytes: int | None = None,
    ttl_s: float | None = None,
    page_dtype: torch.dtype | None = None,
    page_shape: Sequence[int] | None = None,
    connect_timeout_s: float = 0.5,
) -> Storage:
    """The backend ``spec`` names.

    Args:
        spec: ``"memory"``, ``"file:DIR"`` (``~`` expanded), or a server URL ``redis://host:port/db``
            (also ``rediss://``, ``unix://path?db=N``; ``valkey://`` is an alias of ``redis://``).
        suffix, page_nbytes: the deployment suffix and page size (see ``Storage``).
        capacity_bytes: LRU bound (None: unbounded).
        ttl_s: page expiry for a server backend (ignored by the others).
        page_dtype, page_shape: recorded with each page by a server backend and checked on read.
        connect_timeout_s: how long to wait for a server to accept the connection.
    Raises:
        ValueError: an unknown spec.
        StorageUnavailable: the directory is not writable, or the server does not answer (a
            one-line message naming the URL and the reason).
    """
    if spec == "memory":
        from transfer.storage.memory import MemoryStorage

        return MemoryStorage(suffix, page_nbytes, capacity_bytes)
    if isinstance(spec, str) and spec.startswith("file:") and len(spec) > 5:
        from transfer.storage.file import FileStorage

        return FileStorage(os.path.expanduser(spec[5:]), suffix, page_nbytes, capacity_bytes)
    if is_redis_spec(spec):
        from transfer.storage.redis import RedisStorage

        url = "redis://" + spec[len("valkey://"):] if spec.startswith("valkey://") else spec
        url = "rediss://" + spec[len("valkeys://"):] if spec.startswith("valkeys://") else url
        return RedisStorage(url, suffix, page_nbytes, ttl_s, capacity_bytes=capacity_bytes,
                            page_dtype=page_dtype, page_shape=page_shape,
                            connect_timeout_s=connect_timeout_s)
    raise ValueError(f"storage must be 'memory', 'file:DIR', 'redis://HOST:PORT/DB' or a Storage, got {spec!r}")
