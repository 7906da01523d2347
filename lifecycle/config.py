"""Construction checks of ``DecodeOffloadManager``: every impossible configuration is a
``ConfigError`` before anything is built."""

from __future__ import annotations

import re

import torch

from lifecycle.errors import ConfigError

OFFLOADER_METHODS = ("write", "finished_writes", "write_storage", "finished_storage", "free_host", "close")
_HEX64 = re.compile(r"[0-9a-fA-F]{64}\Z")


def positive_int(value, what: str) -> int:
    """``value`` when it is a positive int (not a bool), else ConfigError."""
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ConfigError(f"{what} must be a positive int, got {value!r}")
    return value


def stride(page_size: int, offload_stride) -> int:
    """The offload stride: ``page_size`` when None, else a positive multiple of it."""
    value = page_size if offload_stride is None else positive_int(offload_stride, "offload_stride")
    if value % page_size:
        raise ConfigError(f"offload_stride {value} is not a multiple of page_size {page_size}")
    return value


def namespace_seed(seed) -> str | None:
    """None, or exactly 64 hex characters (returned lowercase)."""
    if seed is None:
        return None
    if not isinstance(seed, str) or not _HEX64.match(seed):
        raise ConfigError(f"namespace_seed must be exactly 64 hex characters, got {seed!r}")
    return seed.lower()


def pools(req_to_token_pool, allocator, page_size: int) -> int:
    """Check the pools; returns the allocator's page size (1 when it has none).

    Raises:
        ConfigError: ``req_to_token`` not a 2-D integer tensor, a pool without ``free``, or an
            allocator page that does not divide the manager's page (a quarantined copy's slots
            would then share an allocator page with slots freed at release).
    """
    rows = getattr(req_to_token_pool, "req_to_token", None)
    if not isinstance(rows, torch.Tensor) or rows.dim() != 2:
        raise ConfigError("req_to_token_pool.req_to_token must be a 2-D tensor")
    if rows.dtype.is_floating_point or rows.dtype.is_complex or rows.dtype == torch.bool:
        raise ConfigError(f"req_to_token_pool.req_to_token must hold integer slots, not {rows.dtype}")
    if not callable(getattr(req_to_token_pool, "free", None)):
        raise ConfigError("req_to_token_pool has no free(req)")
    if not callable(getattr(allocator, "free", None)):
        raise ConfigError("token_to_kv_pool_allocator has no free(indices)")
    alloc_page = getattr(allocator, "page_size", None) or 1
    if not isinstance(alloc_page, int) or isinstance(alloc_page, bool) or alloc_page < 1:
        raise ConfigError(f"token_to_kv_pool_allocator.page_size must be a positive int, got {alloc_page!r}")
    if page_size % alloc_page:
        raise ConfigError(
            f"the allocator's page ({alloc_page} slots) does not divide the manager's page_size ({page_size}): "
            "a stuck copy's quarantined slots would share allocator pages with slots freed at release"
        )
    return alloc_page


def offloader(obj) -> None:
    """The offloader must exist and have every method of the ``transfer.Offloader`` protocol
    (checked once, here: the manager never probes for a method afterwards)."""
    if obj is None:
        raise ConfigError("no offloader: pass offloader=, or use DecodeOffloadManager.from_stack(build_stack(...))")
    missing = [m for m in OFFLOADER_METHODS if not callable(getattr(obj, m, None))]
    if missing:
        raise ConfigError(f"offloader lacks {', '.join(missing)}")


def release_sink(sink) -> None:
    """A custom release sink must have ``check(plan)`` and ``free(plan)``."""
    missing = [m for m in ("check", "free") if not callable(getattr(sink, m, None))]
    if missing:
        raise ConfigError(f"release_sink lacks {', '.join(missing)}")
