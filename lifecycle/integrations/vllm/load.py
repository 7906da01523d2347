"""The worker side of loading stored prefixes into vLLM's KV blocks (``LoadWorker``).

The scheduler side (``lookup.LoadPlanner``) hands each planned load over as a ``LoadJob`` in the
connector metadata: the request, the page names (our sha256 chain: the names an SGLang node stores
the same tokens under) and the vLLM blocks they go to, page ``i`` into ``block_ids[i]``.

``start`` queues the step's jobs on ``threads`` loader threads. A job reads its pages from the tier
(``Storage.batch_get``) into host staging pages (a ``HostPool`` from the layout: pinned on CUDA,
``chunk_pages`` pages per thread, so memory is bounded whatever the load), then writes them into
the blocks through ``VllmKVLayout.from_host`` (host page -> vLLM's per-layer views, bit-exact). It
stops at the first page it cannot serve: a page missing, refused by its seal (corrupt, foreign), a
tier that raised (down), or a job older than ``load_timeout_s`` (the write is fenced: a read that
returns after its job timed out never touches the blocks, which vLLM recomputes by then).

A job ends loaded or short; either way it is reported once: an asynchronous job's request in
``finished_recving`` (vLLM's ``finished_recving``), and the blocks it did not fill, from the first
page it could not serve on, in ``load_error_block_ids`` (vLLM's ``get_block_ids_with_load_errors``,
in the same step: vLLM recomputes them). A fault costs a miss, never the engine: nothing here
raises into vLLM for a tier or a page. A synchronous job (``LoadJob.sync``) feeds this step's
forward: ``wait`` (``wait_for_layer_load``) blocks until the step's synchronous jobs end (at most
``load_timeout_s``), and it is never reported in ``finished_recving`` (vLLM asserts so).
"""

from __future__ import annotations

import itertools
import queue
import threading
import time
from collections.abc import Callable, Iterable

import msgspec
import numpy as np

from lifecycle.errors import ConfigError
from lifecycle.log import RateLimitedLog, get_logger
from transfer.errors import StorageError
from transfer.storage.base import Storage
from transfer.worker import BackgroundWorker

log = get_logger(__name__)

#: a load job not ended this long after ``start`` is a miss (its blocks are recomputed)
DEFAULT_LOAD_TIMEOUT_S = 30.0


class LoadJob(msgspec.Struct, frozen=True):
    """One request's load: page ``page_hashes[i]`` (a chain name, without the tier's suffix) into
    vLLM block ``block_ids[i]``. ``sync``: the step's forward reads it (``wait_for_layer_load``
    waits); otherwise vLLM waits for ``finished_recving``. Crosses processes in the connector
    metadata (msgspec, picklable)."""

    req_id: str
    page_hashes: list[str]
    block_ids: list[int]
    sync: bool = False


class LoadStats(msgspec.Struct):
    """Loads since construction. ``jobs``: reported; ``pages_loaded``: pages written into blocks;
    ``pages_failed``: blocks reported in ``load_error_block_ids``; ``jobs_short``: jobs that did
    not load every page; ``missing``: pages the tier did not serve (absent, corrupt, foreign);
    ``tier_errors``: reads that raised; ``timed_out``: jobs past ``load_timeout_s``; ``errors``:
    jobs that failed otherwise (a bug: logged with its exception)."""

    jobs: int = 0
    pages_loaded: int = 0
    pages_failed: int = 0
    jobs_short: int = 0
    missing: int = 0
    tier_errors: int = 0
    timed_out: int = 0
    errors: int = 0


class _State:
    """A job in flight. ``loaded``: leading pages written; ``cancelled``: timed out (no more
    writes: ``lock`` fences them); ``done``: the loader thread left the job."""

    __slots__ = ("tag", "job", "started", "lock", "loaded", "cancelled", "done", "why")

    def __init__(self, tag: int, job: LoadJob, started: float) -> None:
        self.tag, self.job, self.started = tag, job, started
        self.lock = threading.Lock()
        self.loaded = 0
        self.cancelled = False
        self.done = threading.Event()
        self.why: str | None = None


class LoadWorker:
    """Loads ``LoadJob``s from storage into vLLM's KV blocks (see the module docstring).

    Args:
        layout: the ``VllmKVLayout`` of the worker's KV caches (from ``register_kv_caches``).
        storage: this rank's tier (its suffix names this rank's pages); pages of
            ``layout.page_nbytes`` bytes.
        threads: loader threads, >= 1.
        chunk_pages: staging pages per thread (a longer job is read in chunks), >= 1.
        load_timeout_s: a job not ended this long after ``start`` is a miss, > 0.
        pin: pin the staging pages (None: when CUDA is available; pageable if pinning fails).
        clock: monotonic seconds (tests may inject one).
    Raises:
        ConfigError: a bad count or deadline, a storage without ``batch_get``, a tier whose page
            size is not the layout's. Nothing is started then.
    """

    def __init__(self, layout, storage: Storage, *, threads: int = 2, chunk_pages: int = 32,
                 load_timeout_s: float = DEFAULT_LOAD_TIMEOUT_S, pin: bool | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        for what, value in (("threads", threads), ("chunk_pages", chunk_pages)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"{what} must be an int >= 1, got {value!r}")
        if isinstance(load_timeout_s, bool) or not isinstance(load_timeout_s, (int, float)) \
                or not load_timeout_s > 0:
            raise ConfigError(f"load_timeout_s must be a number > 0, got {load_timeout_s!r}")
        if not callable(getattr(storage, "batch_get", None)):
            raise ConfigError(f"storage {storage!r} has no batch_get")
        nbytes = getattr(storage, "page_nbytes", None)
        if nbytes is not None and nbytes != layout.page_nbytes:
            raise ConfigError(f"the tier's pages are {nbytes} bytes, this KV cache's {layout.page_nbytes}")
        self.layout, self.storage = layout, storage
        self.chunk_pages, self.load_timeout_s = chunk_pages, float(load_timeout_s)
        self._clock = clock
        self.host = layout.host_pool(threads * chunk_pages * layout.block_size, pin=pin, allow_pageable=True)
        self._slots: queue.SimpleQueue = queue.SimpleQueue()  # one staging slice per thread
        for i in range(threads):
            self._slots.put(np.arange(i * chunk_pages, (i + 1) * chunk_pages))
        self._worker = BackgroundWorker("kv-vllm-load", threads)
        self._tags = itertools.count()
        self._jobs: dict[int, _State] = {}      # in flight, not yet reported
        self._sync: list[_State] = []           # this step's synchronous jobs (wait)
        self._recving: set[str] = set()
        self._errors: set[int] = set()
        self._stats = LoadStats()
        self._stats_lock = threading.Lock()
        self._oplog = RateLimitedLog(log)
        self._closed = False

    # -- start_load_kv ------------------------------------------------------------------------
    def start(self, load_jobs: Iterable[LoadJob] | None) -> None:
        """Queue the step's jobs (``start_load_kv``). Never blocks on storage. A job whose block
        ids lie outside the cache, or whose lists differ in length, is reported failed at once
        (every block id of it that is a real block); after ``close`` every job is."""
        for job in load_jobs or ():
            tag = next(self._tags)
            st = _State(tag, job, self._clock())
            bad = len(job.page_hashes) != len(job.block_ids) or any(
                not 0 <= b < self.layout.num_blocks for b in job.block_ids)
            if bad or self._closed:
                st.why = "closed" if self._closed else "malformed job"
                self._jobs[tag] = st
                self._end(tag, st)
                continue
            self._jobs[tag] = st
            if job.sync:
                self._sync.append(st)
            self._worker.submit(tag, lambda st=st: self._run(st))

    def _run(self, st: _State) -> None:
        """On a loader thread: read the job's pages chunk by chunk and write them into its blocks."""
        slot = self._slots.get()  # never waits: one slice per thread
        try:
            job, host, chunk = st.job, self.host, self.chunk_pages
            for s in range(0, len(job.page_hashes), chunk):
                if st.cancelled:
                    return
                names = job.page_hashes[s:s + chunk]
                pages = slot[:len(names)]
                try:
                    got = self.storage.batch_get(names, [host.page_bytes(int(p)) for p in pages])
                except (StorageError, OSError) as err:
                    self._count("tier_errors")
                    st.why = f"storage read failed: {err!r}"
                    return
                k = got.index(False) if False in got else len(got)
                if k:
                    with st.lock:  # the fence: a timed-out job never writes
                        if st.cancelled:
                            return
                        self.layout.from_host(host, pages[:k], job.block_ids[s:s + k])
                        st.loaded = s + k
                if k < len(names):
                    self._count("missing")
                    st.why = f"page {s + k} ({names[k][:12]}...) not served by the tier"
                    return
        finally:
            self._slots.put(slot)
            st.done.set()

    # -- wait_for_layer_load ------------------------------------------------------------------
    def wait(self, layer_name: str | None = None) -> None:
        """Block until this step's synchronous jobs have ended (``wait_for_layer_load``; every
        layer is written at once, so the first layer's call waits and later ones return), at most
        until each job's deadline: a job past it is fenced and fails."""
        if not self._sync:
            return
        pending, self._sync = self._sync, []
        for st in pending:
            left = st.started + self.load_timeout_s - self._clock()
            if not st.done.wait(max(0.0, left)):
                self._expire(st)

    def _expire(self, st: _State) -> None:
        with st.lock:  # waits for a write in progress, then no other
            if st.done.is_set():
                return
            st.cancelled = True
        self._count("timed_out")
        st.why = f"not loaded within {self.load_timeout_s}s"
        self._end(st.tag, st)

    # -- get_finished / get_block_ids_with_load_errors ----------------------------------------
    def finished_recving(self) -> set[str]:
        """Asynchronous jobs ended since the last call (loaded, short, failed or timed out): their
        request ids. Their failed blocks go to ``load_error_block_ids`` (ask it after this, in
        the same step). Never blocks."""
        for done in self._worker.poll():
            st = self._jobs.get(done.tag)
            if st is None:  # timed out and reported before its thread came back
                continue
            if done.error is not None:
                self._count("errors")
                st.why = f"load failed: {done.error!r}"
                log.error("vllm.load.job_failed", request=st.job.req_id, error=repr(done.error))
            self._end(done.tag, st)
        now = self._clock()
        for st in [st for st in self._jobs.values() if now - st.started >= self.load_timeout_s]:
            self._expire(st)
        out, self._recving = self._recving, set()
        return out

    def load_error_block_ids(self) -> set[int]:
        """Blocks of ended jobs that were not loaded (vLLM recomputes them); each reported once."""
        out, self._errors = self._errors, set()
        return out

    def _end(self, tag: int, st: _State) -> None:
        """Report an ended job once: its request (asynchronous) and the blocks it did not fill."""
        if self._jobs.pop(tag, None) is None:
            return
        job = st.job
        failed = [b for b in job.block_ids[st.loaded:] if 0 <= b < self.layout.num_blocks]
        self._errors.update(failed)
        if not job.sync:
            self._recving.add(job.req_id)
        with self._stats_lock:
            self._stats.jobs += 1
            self._stats.pages_loaded += st.loaded
            self._stats.pages_failed += len(failed)
            self._stats.jobs_short += st.loaded < len(job.block_ids)
        if st.why is not None:
            self._oplog.warning("vllm.load.short", request=job.req_id, loaded=st.loaded,
                                pages=len(job.block_ids), reason=st.why)

    def _count(self, field: str) -> None:
        with self._stats_lock:
            setattr(self._stats, field, getattr(self._stats, field) + 1)

    def stats(self) -> LoadStats:
        """A snapshot of the load counters."""
        with self._stats_lock:
            return msgspec.structs.replace(self._stats)

    def idle(self) -> bool:
        """Whether no job is in flight (every job started has been reported)."""
        return not self._jobs

    def close(self, timeout_s: float | None = 5.0) -> bool:
        """Refuse new jobs (each is reported failed) and let running ones end, waiting at most
        ``timeout_s`` seconds (None: until they end). Returns True when no loader thread is left;
        otherwise the staging pages stay pinned and alive (a stuck read may still write them)."""
        self._closed = True
        self._oplog.flush()
        ended = self._worker.close(timeout_s)
        if ended:
            self.host.close()
        else:
            self.host.keep_pinned()
        return ended
