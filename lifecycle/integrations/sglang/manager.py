"""``DecodeKVCacheOffloadManager``: SGLang's decode-offload manager (0.5.19, 0.5.23), built on the lifecycle.

Same constructor and the same calls as ``sglang.srt.disaggregation.decode_kvcache_offload_manager.
DecodeKVCacheOffloadManager``, so SGLang's scheduler constructs and drives it unchanged (see
``install``). Underneath: our ``DecodeOffloadManager`` (the checked lifecycle), our transfer stack
reading SGLang's device buffers in place, our page-first host pool, the file store SGLang's
``HiCacheFile`` reads, and a release sink that frees through SGLang's tree cache. One code path
for both tested releases; where SGLang changed, the difference is keyed on the release
(``versions``), read at construction (an untested release is refused there).
"""

from __future__ import annotations

import time
import weakref

from lifecycle.integrations.sglang import metrics as sglang_metrics
from lifecycle.integrations.sglang import runtime, versions
from lifecycle.integrations.sglang.audit_trail import close_audit_trail, open_audit_trail
from lifecycle.integrations.sglang.config import OffloadConfig, read_config
from lifecycle.integrations.sglang.device_pool import LayeredKVPool, check_pool_kind, from_sglang
from lifecycle.integrations.sglang.errors import SGLangConfigError
from lifecycle.integrations.sglang.layered_copy import make_layered_copy_engine
from lifecycle.integrations.sglang.release import SGLangReleaseSink
from lifecycle.integrations.sglang.storage import open_storage, plan_storage
from lifecycle.log import get_logger
from lifecycle.manager import DecodeOffloadManager
from lifecycle.states import State
from transfer.host_offloader import HostOffloader
from transfer.host_pool import HostPool
from transfer.shutdown import close_storage

log = get_logger("lifecycle.integrations.sglang")
_ACTIVE: "weakref.WeakSet[DecodeKVCacheOffloadManager]" = weakref.WeakSet()
_WAITING = (State.INFLIGHT, State.FINISHED)  # copies of the request still in flight


def active_managers() -> list:
    """Our managers constructed in this process and not yet shut down."""
    return list(_ACTIVE)


class OngoingOffload:
    """What SGLang reads of ``manager.ongoing_offload``: its ``len()``, the device -> host copies
    not yet settled (0 means no device slot is held for an offload). Read-only. After
    ``release_host_resources`` it is empty: what the shutdown bound cut off is counted in
    ``stats().abandoned`` instead (those copies are never settled)."""

    __slots__ = ("_mgr",)

    def __init__(self, mgr: DecodeOffloadManager) -> None:
        self._mgr = mgr

    def __len__(self) -> int:
        if self._mgr.closed:
            return 0
        stats = self._mgr.stats()
        return stats.inflight_writes + (1 if stats.quarantined_slots else 0)

    def __bool__(self) -> bool:
        return len(self) > 0


class DecodeKVCacheOffloadManager:
    """A drop-in for SGLang 0.5.19's and 0.5.23's decode KV offload manager.

    A request's ``extra_key`` (with its LoRA id) and ``cache_salt`` name the namespace its pages
    are stored under, as SGLang 0.5.23 does (``lifecycle.requests.namespace_of``; plain requests
    keep SGLang 0.5.19's names); ``namespace_of(req)`` returns that seed.

    Args (SGLang's, passed by its scheduler):
        req_to_token_pool: SGLang's ``ReqToTokenPool``.
        token_to_kv_pool_allocator: its allocator; ``get_kvcache()`` must be an
            ``MHATokenToKVPool`` or ``MLATokenToKVPool``.
        tp_group: the TP (or attention-TP) CPU process group; None or a group of one: no agreement.
        tree_cache: SGLang's prefix cache (``free_kv_row``, ``protected_size_``).
    Raises:
        SGLangConfigError: an SGLang release the drop-in is not tested with (``versions``: one
            line; ``KV_LIFECYCLE_SGLANG_UNTESTED_OK=1`` forces it); a hybrid sliding-window pool
            (``device_pool.check_pool_kind``); SGLang's configuration or pools ask for something
            unsupported (see ``config.read_config`` and ``device_pool.from_sglang``); nothing is
            left allocated.
    """

    def __init__(self, req_to_token_pool, token_to_kv_pool_allocator, tp_group, tree_cache) -> None:
        context = runtime.current()
        release = versions.release_of(context)
        get_kvcache = getattr(token_to_kv_pool_allocator, "get_kvcache", None)
        if not callable(get_kvcache):
            raise SGLangConfigError("token_to_kv_pool_allocator has no get_kvcache()")
        kv_cache = get_kvcache()
        check_pool_kind(kv_cache)  # hybrid SWA: refused before its configuration is read
        config = read_config(context, release=release)
        device = from_sglang(kv_cache, token_to_kv_pool_allocator, req_to_token_pool)
        tp_rank, tp_size = _tp_rank_size(tp_group)
        sink = SGLangReleaseSink(tree_cache, req_to_token_pool, release=release)
        plan = plan_storage(config, tp_rank, tp_size, device.mla)
        host = HostPool(device.layers, device.heads, device.head_dim, device.dtype, config.page_size,
                        _host_tokens(config, kv_cache, device), mla=device.mla)
        storage = open_storage(config, host, tp_rank, tp_size, device.mla, plan)
        offloader = audit = None
        try:
            audit = open_audit_trail(tp_rank, config.pp_rank)
            engine = make_layered_copy_engine(device, offload_stride=config.offload_stride,
                                              staging_bytes=config.staging_bytes)
            offloader = HostOffloader(device, host, storage, copy_engine=engine)
            self.manager = DecodeOffloadManager(
                req_to_token_pool, token_to_kv_pool_allocator, page_size=config.page_size,
                offloader=offloader, offload_stride=config.offload_stride,
                tp_group=tp_group if tp_size > 1 else None, release_sink=sink,
            )
        except BaseException:
            if offloader is not None:
                offloader.close()
            storage.close()
            if audit is not None and not _ACTIVE:
                close_audit_trail()
            raise
        self.req_to_token_pool = req_to_token_pool
        self.token_to_kv_pool_allocator = token_to_kv_pool_allocator
        self.tree_cache = tree_cache
        self.tp_group, self.tp_rank, self.tp_world_size = tp_group, tp_rank, tp_size
        self.config: OffloadConfig = config
        self.sglang_release: versions.Release = release
        self.page_size, self.offload_stride = config.page_size, config.offload_stride
        self.device_pool: LayeredKVPool = device
        self.decode_host_mem_pool: HostPool = host
        self.storage, self.offloader, self.release_sink = storage, offloader, sink
        self.ongoing_offload = OngoingOffload(self.manager)
        self._released_host = False
        self._released_by_sglang: weakref.WeakSet = weakref.WeakSet()  # to readmit when back with a row
        self.audit_path = None if audit is None else audit.path
        self.metrics = sglang_metrics.hook(self, context, tp_rank, config.pp_rank)  # --enable-metrics only
        _ACTIVE.add(self)
        log.info("sglang.decode_offload_enabled", sglang=release.version, behaves_as=release.behaves_as,
                 page_size=config.page_size, stride=config.offload_stride,
                 backend=config.storage_backend, storage_dir=config.storage_dir, suffix=storage.suffix,
                 mla=device.mla, layers=device.layers, host_pages=host.num_pages, tp_rank=tp_rank, tp_size=tp_size)

    # --- SGLang's calls ----------------------------------------------------------------------------

    def offload_kv_cache(self, req) -> bool:
        """After a decode step: enqueue the request's next full chunk. See ``DecodeOffloadManager``.
        A request SGLang released itself (retracted) and resumed with a new row is readmitted first."""
        if self._released_by_sglang.data and req in self._released_by_sglang and not self._readmit(req):
            return False
        return self.manager.offload_kv_cache(req)

    def check_offload_progress(self) -> None:
        """Every scheduler iteration: settle landed copies and stored pages, release finished requests."""
        self.manager.check_offload_progress()

    def finalize_release_on_finish(self, req) -> None:
        """A finished request with nothing more to offload: release now or when its copies land.
        A request SGLang already released itself and that holds no row again has nothing to free."""
        if self._released_by_sglang.data and req in self._released_by_sglang and not self._readmit(req):
            return
        self.manager.finalize_release_on_finish(req)

    def has_inflight_device_transfer(self) -> bool:
        """SGLang 0.5.23's unified-memory move gate: whether a device -> host copy may still read
        device KV (``len(ongoing_offload) > 0``)."""
        return len(self.ongoing_offload) > 0

    def drain_before_retraction(self) -> None:
        """SGLang 0.5.23 calls this before it retracts decode requests (whose slots it then frees
        itself): settle the copies that read device KV before SGLang frees it.

        Polls ``check_offload_progress`` until no device -> host copy is in flight. With TP every
        rank settles the same copies per poll (the manager's agreement), so all ranks poll equally
        often and stop together; with TP=1 the wait is bounded by ``SGLANG_RELEASE_WAIT_S``, after
        which it returns and the retraction's ``release_kv_cache`` (through ``install()``'s hook)
        handles each request as ``before_sglang_release`` does. Never raises for a copy in flight
        (SGLang's own manager raises ``RuntimeError`` there).
        """
        if self._released_host:
            return
        self.manager.check_offload_progress()
        deadline = None if self.tp_world_size > 1 else time.monotonic() + self.SGLANG_RELEASE_WAIT_S
        while self.manager.stats().inflight_writes:
            if deadline is not None and time.monotonic() > deadline:
                log.warning("sglang.drain_before_retraction_bound", waited_s=self.SGLANG_RELEASE_WAIT_S,
                            inflight=self.manager.stats().inflight_writes)
                return
            time.sleep(0.0002)
            self.manager.check_offload_progress()

    def before_sglang_release(self, req) -> bool:
        """SGLang is about to free ``req``'s KV itself (``release_kv_cache``: retraction, abort).

        Waits for the request's copies still reading its slots (polling ``check_offload_progress``;
        with TP every rank settles the same copies per poll, so all ranks poll equally often), then
        ends its lifecycle here without freeing anything: SGLang frees. Called by the hook
        ``install()`` puts on ``release_kv_cache``.

        Returns:
            False when the lifecycle released the request itself while waiting (a finished request
            whose last copy landed): SGLang must not free it again. True otherwise.
        """
        if self._released_host:
            return True
        state = self.manager.state_of(req)
        if state is None or state is State.RELEASED:
            return True
        deadline = None if self.tp_world_size > 1 else time.monotonic() + self.SGLANG_RELEASE_WAIT_S
        while state in _WAITING:
            self.manager.check_offload_progress()
            state = self.manager.state_of(req)
            if state not in _WAITING:
                break
            if deadline is not None and time.monotonic() > deadline:
                return self._release_under_copy(req, state)
            time.sleep(0.0002)
        if state is State.RELEASED:
            return False
        with self.release_sink.released_by_sglang(req):
            self.manager.finalize_release_on_finish(req)
        self._released_by_sglang.add(req)
        log.debug("sglang.released_by_sglang", rid=getattr(req, "rid", None))
        return True

    def _release_under_copy(self, req, state: State) -> bool:
        """TP=1, the wait bound passed: SGLang frees the request's slots although copies of it may
        still read them. Those copies are expired now (their pages are never stored: the slots may
        be reused under them), and the request's lifecycle ends without freeing, as SGLang frees it;
        the slots an expired copy may read are SGLang's, never freed by us. When the request
        resumes with a new row, its next ``offload_kv_cache`` starts a new lifecycle."""
        acks = self.manager.copies_of(req)
        log.error("sglang.release_under_copy", rid=getattr(req, "rid", None), state=state.name,
                  waited_s=self.SGLANG_RELEASE_WAIT_S, copies_discarded=len(acks), ack_ids=acks)
        self.offloader.expire(acks)  # HostOffloader.discard_write each: counted in copies_discarded
        with self.release_sink.released_by_sglang(req):
            self.manager.check_offload_progress()  # settles the expired copies; others as usual
            if self.manager.state_of(req) not in (None, State.RELEASED):
                self.manager.finalize_release_on_finish(req)
        self.manager.disown_expired_copies(acks)  # SGLang frees these slots (and may reuse them)
        self._released_by_sglang.add(req)
        log.debug("sglang.released_by_sglang", rid=getattr(req, "rid", None))
        return True

    SGLANG_RELEASE_WAIT_S = 10.0  # TP=1 only: then SGLang frees anyway (logged sglang.release_under_copy)

    def _readmit(self, req) -> bool:
        """Start a new lifecycle for a request SGLang released and gave a row again; False if it has none."""
        row = getattr(req.kv, "req_pool_idx", None)
        if row is None or row == -1:
            return False
        self._released_by_sglang.discard(req)
        self.manager.readmit(req)
        return True

    def release_host_resources(self, timeout_s: float | None = None) -> None:
        """At shutdown (SGLang calls it from the scheduler process's ``finally``): drain accepted
        work within a bound, stop the workers, close the store. Idempotent; never raises for work
        still in flight.

        Copies already accepted land, their pages are written to storage and waited for, and
        finished requests are released through SGLang's tree cache, for at most ``timeout_s``
        seconds (default: ``KV_LIFECYCLE_SGLANG_SHUTDOWN_TIMEOUT_S``, else 5): one deadline for the
        whole call — the drain, the offloader's close and the store's close share it, each getting
        what the one before left). Whatever the bound cut off is logged once
        (``lifecycle.abandoned``, ERROR, with what was pending) and counted (``stats().abandoned``); its device slots
        stay allocated (a copy may still read them), and the host pool stays pinned and allocated
        until the process ends (``HostPool.keep_pinned``: a copy may still write into it), never
        unpinned at exit. No device memory is read here. ``ongoing_offload`` is empty afterwards.
        """
        if self._released_host:
            return
        self._released_host = True
        _ACTIVE.discard(self)
        bound = self.config.shutdown_timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + bound  # one bound for the whole call: the store gets what is left
        try:
            self.manager.shutdown(force=True, timeout_s=bound)
        finally:
            close_storage(self.storage, max(0.0, deadline - time.monotonic()))
        stats = self.manager.stats()  # what the bound cut off: logged once by the manager (lifecycle.abandoned)
        if self.metrics is not None:
            self.metrics.tick(force=True)
        if self.offloader.idle():  # no copy can still write into the host pool: unpin it
            self.decode_host_mem_pool.close()
        else:  # an abandoned copy may still write into it: pinned and alive until the process ends
            self.decode_host_mem_pool.keep_pinned()
        log.info("sglang.host_resources_released", released=stats.released, leaked=stats.leaked,
                 pages_stored=self.offloader.stats().pages_stored, abandoned=stats.abandoned,
                 timeout_s=bound)
        if self.audit_path is not None and not _ACTIVE:
            close_audit_trail()

    # --- inspection (tests, operators) --------------------------------------------------------------

    def idle(self) -> bool:
        """True when no copy and no storage write is in flight."""
        return self.manager.idle()

    def stats(self):
        """The lifecycle's counters (``lifecycle.Stats``)."""
        return self.manager.stats()

    def check_integrity(self) -> None:
        """Raise ``IntegrityError`` unless the lifecycle's tables agree."""
        self.manager.check_integrity()

    def namespace_of(self, req) -> str | None:
        """The namespace seed ``req``'s pages are named under (None: a plain request); see
        ``DecodeOffloadManager.namespace_of``."""
        return self.manager.namespace_of(req)


def _tp_rank_size(group) -> tuple[int, int]:
    import torch.distributed as dist

    if group is None or not dist.is_available() or not dist.is_initialized():
        return 0, 1
    return dist.get_rank(group=group), dist.get_world_size(group=group)


def _host_tokens(config: OffloadConfig, kv_cache, device: LayeredKVPool) -> int:
    """SGLang's host pool size: ``hicache_size`` GB, else ``hicache_ratio`` x the device pool's
    ``size``; rounded to whole pages plus one (``HostKVCache.__init__``)."""
    per_token = device.kinds * device.layers * device.row_bytes
    if config.host_size_gb > 0:
        tokens = int(config.host_size_gb * 1e9 // per_token)
    else:
        size = getattr(kv_cache, "size", None)
        if not isinstance(size, int) or size < 1:
            raise SGLangConfigError(f"{type(kv_cache).__name__}.size must be a positive int, got {size!r}")
        tokens = int(size * config.host_ratio)
    return (tokens // config.page_size + 1) * config.page_size


__all__ = ["DecodeKVCacheOffloadManager", "OngoingOffload"]
