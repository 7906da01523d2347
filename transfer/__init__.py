"""Mechanism: KV and host memory, the copy engine and storage. Executes jobs; decides nothing."""

from transfer.allocator import PagedTokenAllocator
from transfer.copy_engine import CpuCopyEngine, CudaCopyEngine, make_copy_engine
from transfer.errors import (
    BadIndices,
    Closed,
    DeviceMismatch,
    DoubleFree,
    HostPagesBusy,
    IntegrityError,
    InvalidFree,
    NotAllocated,
    PageSizeMismatch,
    PinningFailed,
    PoolExhausted,
    StorageError,
    StorageUnavailable,
    TransferError,
    UnknownId,
)
from transfer.host_offloader import HostOffloader, OffloaderStats
from transfer.host_pool import HostPool
from transfer.kv_pool import KVPool
from transfer.offloader import EMPTY_REPORT, Offloader, WriteReport
from transfer.prefix import PrefixLoad, PrefixLoader
from transfer.req_pool import ReqToTokenPool
from transfer.stack import TransferStack, build_stack
from transfer.storage import FileStorage, MemoryStorage, Storage, StorageStats, open_storage

__all__ = [
    "BadIndices",
    "Closed",
    "DeviceMismatch",
    "CpuCopyEngine",
    "CudaCopyEngine",
    "DoubleFree",
    "FileStorage",
    "HostOffloader",
    "HostPagesBusy",
    "HostPool",
    "IntegrityError",
    "InvalidFree",
    "KVPool",
    "MemoryStorage",
    "NotAllocated",
    "Offloader",
    "EMPTY_REPORT",
    "WriteReport",
    "OffloaderStats",
    "PageSizeMismatch",
    "PinningFailed",
    "PagedTokenAllocator",
    "PoolExhausted",
    "PrefixLoad",
    "PrefixLoader",
    "ReqToTokenPool",
    "Storage",
    "StorageError",
    "StorageStats",
    "StorageUnavailable",
    "TransferError",
    "TransferStack",
    "UnknownId",
    "build_stack",
    "make_copy_engine",
    "open_storage",
]


def __getattr__(name):  # RedisStorage imports the redis client only when used
    if name == "RedisStorage":
        from transfer.storage.redis.store import RedisStorage

        return RedisStorage
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
