"""Page storage backends: the ``Storage`` interface, in-memory, file (SGLang HiCacheFile naming) and
Redis/Valkey (``RedisStorage``, imported on first use); ``open_storage`` opens one from a spec.
``PageFormat`` / the seal (``integrity``) and ``CircuitBreaker`` are shared by every tier."""

from transfer.storage.base import IndexedStorage, Storage, StorageStats
from transfer.storage.breaker import BreakerState, CircuitBreaker
from transfer.storage.integrity import PageFormat, Verdict
from transfer.storage.file import FileStorage
from transfer.storage.memory import MemoryStorage
from transfer.storage.spec import is_redis_spec, open_storage

__all__ = [
    "BreakerState", "CircuitBreaker", "FileStorage", "IndexedStorage", "MemoryStorage", "PageFormat",
    "RedisStorage", "RedisStorageStats", "Storage", "StorageStats", "Verdict", "is_redis_spec", "open_storage",
]


def __getattr__(name):  # the redis client is imported only when the Redis backend is used
    if name in ("RedisStorage", "RedisStorageStats"):
        from transfer.storage import redis as _redis

        return getattr(_redis, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
