"""Open a storage backend from a one-line spec: ``memory``, ``file:DIR``, ``redis://host:port/db``."""

from __future__ import annotations

import os
from transfer.storage.base import Storage
from transfer.storage.integrity import PageFormat
from transfer.storage.retention import merge, split_retention_options

REDIS_SCHEMES = ("redis://", "rediss://", "unix://", "valkey://", "valkeys://")


def is_redis_spec(spec: str) -> bool:
    """Whether ``spec`` names a Redis/Valkey server."""
    return isinstance(spec, str) and spec.startswith(REDIS_SCHEMES)


CLUSTER_SCHEMES = ("redis+cluster://", "rediss+cluster://", "valkey+cluster://", "valkeys+cluster://")


def is_server_spec(spec: str) -> bool:
    """Whether ``spec`` names a storage server ``open_storage`` knows: Redis/Valkey, a Redis
    Cluster (``redis+cluster://``) or a Mooncake master (``mooncake://``)."""
    return is_redis_spec(spec) or (isinstance(spec, str) and spec.startswith(CLUSTER_SCHEMES + ("mooncake://",)))


def open_storage(
    spec: str,
    suffix: str = "",
    page_nbytes: int | None = None,
    *,
    capacity_bytes: int | None = None,
    ttl_s: float | None = None,
    key_prefix: str = "",
    page_format: PageFormat | None = None,
    require_checksum: bool = False,
    connect_timeout_s: float = 0.5,
) -> Storage:
    """The backend ``spec`` names.

    Args:
        spec: ``"memory"``, ``"file:DIR"`` (``~`` expanded), or a server URL ``redis://host:port/db``
            (also ``rediss://``, ``unix://path?db=N``; ``valkey://`` is an alias of ``redis://``),
            or ``redis+cluster://HOST:PORT`` (any node of a Redis/Valkey Cluster), or
            ``mooncake://HOST:PORT?options`` (a Mooncake master; see ``mooncake_conn``).
        suffix, page_nbytes: the deployment suffix and page size (see ``Storage``).
        capacity_bytes: LRU bound (None: unbounded).
        ttl_s: page expiry for a server backend (ignored by the others).
        key_prefix: prepended to every Redis / Redis Cluster key (ignored by the others).
            ``capacity_bytes``, ``ttl_s`` and ``key_prefix`` may also be query options of ``spec``
            (``transfer.storage.retention``: ``redis://h:6379/0?ttl_s=3600&key_prefix=kv:``,
            ``file:DIR?capacity_bytes=N``); an option in both places with different values is an error.
        page_format: what the pages are (layout, dtype, shape), sealed with every page and checked
            on read by every backend (None: each page's own dtype and shape, layout ``raw``).
        require_checksum: strict mode (memory and file): a page without a seal is a miss.
        connect_timeout_s: how long to wait for a server to accept the connection.
    Raises:
        ValueError: an unknown spec. StorageConfigError (a ValueError): a bad URL (e.g. a
            non-numeric database), suffix or format.
        StorageUnavailable: the directory is not writable, or the server does not answer (a
            one-line message naming the URL and the reason).
    """
    spec, retention = split_retention_options(spec)
    capacity_bytes = merge("capacity_bytes", retention, capacity_bytes)
    ttl_s, key_prefix = merge("ttl_s", retention, ttl_s), merge("key_prefix", retention, key_prefix)
    if spec == "memory":
        from transfer.storage.memory import MemoryStorage

        return MemoryStorage(suffix, page_nbytes, capacity_bytes, page_format=page_format,
                             require_checksum=require_checksum)
    if isinstance(spec, str) and spec.startswith("file:") and len(spec) > 5:
        from transfer.storage.file import FileStorage

        return FileStorage(os.path.expanduser(spec[5:]), suffix, page_nbytes, capacity_bytes,
                           require_checksum=require_checksum, page_format=page_format)
    if is_redis_spec(spec):
        from transfer.storage.redis import RedisStorage

        url = "redis://" + spec[len("valkey://"):] if spec.startswith("valkey://") else spec
        url = "rediss://" + spec[len("valkeys://"):] if spec.startswith("valkeys://") else url
        return RedisStorage(url, suffix, page_nbytes, ttl_s, capacity_bytes=capacity_bytes,
                            page_format=page_format, connect_timeout_s=connect_timeout_s, key_prefix=key_prefix)
    if isinstance(spec, str) and spec.startswith(CLUSTER_SCHEMES):
        from transfer.storage.redis_cluster import RedisClusterStorage

        return RedisClusterStorage(spec, suffix, page_nbytes, ttl_s, capacity_bytes=capacity_bytes,
                                   page_format=page_format, connect_timeout_s=connect_timeout_s,
                                   key_prefix=key_prefix)
    if isinstance(spec, str) and spec.startswith("mooncake://"):
        from transfer.storage.mooncake import MooncakeStorage
        from transfer.storage.mooncake_conn import parse_spec

        return MooncakeStorage(parse_spec(spec), suffix, page_nbytes, page_format=page_format,
                               require_checksum=require_checksum)
    raise ValueError(f"storage must be 'memory', 'file:DIR', 'redis://HOST:PORT/DB', 'redis+cluster://HOST:PORT', "
                     f"'mooncake://HOST:PORT' or a Storage, got {spec!r}")
