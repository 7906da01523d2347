"""Page storage backends: the ``Storage`` interface, in-memory, file (SGLang HiCacheFile naming) and
Redis/Valkey (``RedisStorage``, imported on first use); ``open_storage`` opens one from a spec."""

from transfer.storage.base import IndexedStorage, Storage, StorageStats
from transfer.storage.file import FileStorage
from transfer.storage.memory import MemoryStorage
from transfer.storage.spec import is_redis_spec, open_storage

__all__ = [
    "FileStorage", "IndexedStorage", "MemoryStorage", "RedisStorage", "RedisStorageStats", "Storage",
    "StorageStats", "is_redis_spec", "open_storage",
]


def __getattr__(name):  # the redis client is imported only when the Redis backend is used
    if name in ("RedisStorage", "RedisStorageStats"):
        from transfer.storage import redis as _redis

        return getattr(_redis, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
