"""Build a whole transfer stack (pools, storage, offloader, prefix loader) from a model shape."""

from __future__ import annotations

import time
from dataclasses import dataclass

import msgspec
import torch

from transfer.allocator import PagedTokenAllocator
from transfer.host_offloader import HostOffloader
from transfer.host_pool import HostPool
from transfer.kv_pool import KVPool
from transfer.prefix import PrefixLoader
from transfer.req_pool import ReqToTokenPool
from transfer.shutdown import DEFAULT_CLOSE_TIMEOUT_S, CloseReport, check_timeout, close_storage
from transfer.storage.base import Storage
from transfer.storage.identity import DeploymentIdentity
from transfer.storage.integrity import PageFormat
from transfer.storage.spec import open_storage

HOST_LAYOUT = "page_first"  # our host pool's layout (SGLang's default); a tier may store another


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
    identity: DeploymentIdentity | None = None

    def close(self, timeout: float | None = DEFAULT_CLOSE_TIMEOUT_S) -> CloseReport:
        """Drain and stop the workers, then release the storage backend, waiting at most
        ``timeout`` seconds in all (default ``DEFAULT_CLOSE_TIMEOUT_S``; None: without bound).
        Copies, storage ops, prefix loads and the storage tier's own page writes (a file write in
        a hung filesystem call) still running at the deadline are abandoned, never waited on
        forever.

        Returns:
            The offloader's ``CloseReport``, not ``clean`` also when a prefix load was abandoned,
            with ``abandoned_pages`` naming the tier's page writes abandoned.
        Raises:
            ValueError: ``timeout`` negative or not a number.
        """
        check_timeout(timeout)
        deadline = None if timeout is None else time.monotonic() + timeout
        report = self.offloader.close(timeout)
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        if not self.prefix_loader.close(left):
            why = f"prefix loads still running after {timeout}s (their device slots and host pages stay held)"
            report = msgspec.structs.replace(report, clean=False, reason="; ".join(filter(None, [report.reason, why])))
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        pages = close_storage(self.storage, left)
        if pages:
            why = (f"{len(pages)} storage page writes still running after {timeout}s (a hung storage call "
                   f"cannot be cancelled; those pages may still appear)")
            report = msgspec.structs.replace(report, clean=False, abandoned_pages=pages,
                                             reason="; ".join(filter(None, [report.reason, why])))
        if report.clean:  # nothing copies into or stores from the host pool any more: unpin it
            self.host_pool.close()
        else:  # an abandoned copy may still write into it: pinned and alive until the process ends
            self.host_pool.keep_pinned()
        return report


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
    *,
    pp_rank: int = 0,
    pp_size: int = 1,
    attn_cp_rank: int = 0,
    attn_cp_size: int = 1,
    storage_require_checksum: bool = False,
    lookup_timeout_s: float | None = 0.05,
    backend_tag: str | None = None,
    host_layout: str = HOST_LAYOUT,
    kv_events=None,
) -> TransferStack:
    """Build a stack.

    Args:
        layers, heads, head_dim, dtype: model KV shape (MLA: heads = 1, head_dim = latent width).
        page_size: tokens per page.
        device_tokens: allocatable device slots (the pool gets ``page_size`` more for padding).
        host_tokens: host pool capacity in tokens.
        rows, max_len: req-to-token pool shape.
        storage: a spec ``open_storage`` takes ("memory", "file:DIR", "redis://HOST:PORT/DB" (Redis or
            Valkey), "redis+cluster://HOST:PORT", "mooncake://HOST:PORT?..."; retention options as
            in ``transfer.storage.retention``), or a ready ``Storage``.
        device: "cpu" or "cuda".
        mla: latent-only KV.
        model_name, tp_rank, tp_size, pp_rank, pp_size, attn_cp_rank, attn_cp_size, backend_tag,
            host_layout: the deployment identity (``TransferStack.identity``) every built tier names
            its pages from as SGLang does: file suffix, Mooncake objects, Redis keys.
            ``host_layout`` (``page_first``, ``page_first_direct``, ``page_head``) is the byte
            order pages are stored in, recorded in their seals.
        storage_capacity_bytes: LRU bound for a built backend.
        storage_ttl_s: page expiry for a Redis backend (None: never).
        storage_require_checksum: strict mode: a stored page without a seal is a miss.
        lookup_timeout_s: the prefix loader's deadline on a storage lookup (``PrefixLoader``).
        kv_events: a ``transfer.kv_events.KVEventPublisher`` (or None): pages handed from the host
            pool to storage are announced ``CPU_PINNED`` and the tier's writes and removals with
            the tier's medium (``attach_events``).
    A built backend seals every page with its format: the stored layout, the KV dtype and the
    page shape in that layout (``page_format(...)`` for ``page_first``).
    Raises:
        ValueError: bad sizes or an unknown storage spec. StorageConfigError (a ValueError): a
        deployment a tier cannot name or lay out as SGLang does. StorageUnavailable: unwritable
        dir, or an unreachable server.
    """
    identity = DeploymentIdentity(model_name=model_name, backend_tag=backend_tag, tp_rank=tp_rank, tp_size=tp_size,
                                  pp_rank=pp_rank, pp_size=pp_size, attn_cp_rank=attn_cp_rank,
                                  attn_cp_size=attn_cp_size, mla=mla, layout=host_layout)
    kv = KVPool(layers, heads, head_dim, dtype, device_tokens + page_size, device=device, mla=mla)
    host = HostPool(layers, heads, head_dim, dtype, page_size, host_tokens, mla=mla)
    if isinstance(storage, Storage):
        store = storage
    else:
        store = open_storage(storage, page_nbytes=host.page_nbytes, identity=identity,
                             capacity_bytes=storage_capacity_bytes, ttl_s=storage_ttl_s,
                             page_format=page_format(host), require_checksum=storage_require_checksum)
    allocator = PagedTokenAllocator(device_tokens, page_size)
    stack = TransferStack(
        kv_pool=kv,
        allocator=allocator,
        req_to_token_pool=ReqToTokenPool(rows, max_len, device=device),
        host_pool=host,
        storage=store,
        offloader=HostOffloader(kv, host, store),
        prefix_loader=PrefixLoader(kv, allocator, host, store, lookup_timeout_s=lookup_timeout_s),
        identity=identity,
    )
    if kv_events is not None:
        attach_events(stack, kv_events)
    return stack


def attach_events(stack: TransferStack, publisher) -> None:
    """Announce the stack's pages on ``publisher``: the storage tier's writes and removals
    (``storage.events``, medium from ``kv_events.medium_of``) and the host pages handed to storage
    (``offloader.events``, ``CPU_PINNED``)."""
    from transfer.kv_events.announcer import HostAnnouncer, TierAnnouncer, medium_of

    page_size = stack.host_pool.page_size
    stack.storage.events = TierAnnouncer(publisher, medium_of(stack.storage), page_size)
    stack.offloader.events = HostAnnouncer(publisher, page_size)


def page_format(host: HostPool) -> PageFormat:
    """The format of the host pool's pages as SGLang's page_first host layout names it: MHA
    ``(2, page_size, layers, heads, head_dim)``, MLA ``(page_size, layers, 1, latent width)``."""
    shape = tuple(host.buffer.shape[1:])
    if host.mla:
        shape = shape[1:]  # the single latent kind
    return PageFormat.of(HOST_LAYOUT, host.buffer.dtype, shape)
