"""Page storage backends: the ``Storage`` interface, in-memory, file (SGLang HiCacheFile naming) and
Redis/Valkey, Redis Cluster and Mooncake (``RedisStorage``, ``RedisClusterStorage``,
``MooncakeStorage``: imported on first use); ``open_storage`` opens one from a spec.
``PageFormat`` / the seal (``integrity``) and ``CircuitBreaker`` are shared by every tier."""

from transfer.storage.base import IndexedStorage, Storage, StorageStats
from transfer.storage.breaker import BreakerState, CircuitBreaker
from transfer.storage.integrity import PageFormat, Verdict
from transfer.storage.file import FileStorage
from transfer.storage.memory import MemoryStorage
from transfer.storage.spec import is_redis_spec, is_server_spec, open_storage

__all__ = [
    "BreakerState", "CircuitBreaker", "FileStorage", "IndexedStorage", "MemoryStorage", "MooncakeStorage",
    "PageFormat", "RedisClusterStorage", "RedisStorage", "RedisStorageStats", "Storage", "StorageStats", "Verdict",
    "is_redis_spec", "is_server_spec", "open_storage",
]
_LAZY = {"RedisStorage": "redis.store", "RedisStorageStats": "redis.store", "RedisClusterStorage": "redis.cluster",
         "MooncakeStorage": "mooncake.store"}


def __getattr__(name):  # a server's client library is imported only when its backend is used
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f"transfer.storage.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
