"""The transfer package's error hierarchy: every failure a caller can see is a ``TransferError``."""

from __future__ import annotations


class TransferError(Exception):
    """Base of every error raised by the transfer package."""


class BadIndices(TransferError, ValueError):
    """Indices are malformed: wrong dtype or shape, out of range, or not whole aligned pages."""


class InvalidFree(TransferError):
    """A free would corrupt a pool; nothing was changed."""


class DoubleFree(InvalidFree):
    """Freeing pages (or a row) that were allocated once and are already free."""


class NotAllocated(InvalidFree):
    """Freeing pages (or a row) that were never handed out."""


class PoolExhausted(TransferError):
    """A pool cannot satisfy an allocation the caller required to succeed."""


class IntegrityError(TransferError):
    """A pool's bookkeeping is inconsistent (free + held != total, or a page both free and held)."""


class UnknownId(TransferError, KeyError):
    """An ack/op id is unknown or already in use."""


class HostPagesBusy(TransferError):
    """Host pages are still read by an in-flight storage op and cannot be freed yet."""


class DeviceMismatch(TransferError, ValueError):
    """A copy engine was given a pool on a device it cannot copy from (the CPU engine and a CUDA
    pool: its worker threads would read device memory with no stream order); nothing was queued."""


class PinningFailed(TransferError, RuntimeError):
    """A host pool could not be pinned (page-locked) for the GPU and the caller did not allow
    pageable memory; nothing stays allocated."""


class Closed(TransferError):
    """The component was closed; it accepts no more work."""


class StorageError(TransferError):
    """A storage backend failed (I/O error, disk full, permission)."""


class StorageUnavailable(StorageError):
    """A storage backend cannot be used at all (e.g. its directory is not writable)."""


class PageSizeMismatch(StorageError, ValueError):
    """A page buffer's byte size differs from the backend's page size."""


class InvalidPage(StorageError, ValueError):
    """A page tensor a tier cannot store byte-exact (dtype, layout, device, view bits, autograd), or a
    batch whose lengths differ; nothing of the batch was touched."""


class InvalidKey(StorageError, ValueError):
    """A storage key is not a page hash (64 lowercase hex characters); nothing of the batch was touched."""


class StorageConfigError(StorageError, ValueError):
    """A storage backend was configured with a bad value (URL, suffix, page format); nothing was opened."""

