"""Page storage backends: the ``Storage`` interface, in-memory and file (SGLang HiCacheFile naming)."""

from transfer.storage.base import IndexedStorage, Storage, StorageStats
from transfer.storage.file import FileStorage
from transfer.storage.memory import MemoryStorage

__all__ = ["FileStorage", "IndexedStorage", "MemoryStorage", "Storage", "StorageStats"]
