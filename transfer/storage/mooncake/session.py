"""The life of one Mooncake client inside a store: connect (now, or lazily in the background),
count calls in flight, and close without freezing the process.

Mooncake's client ``setup`` and ``close`` hold the GIL (measured: every Python thread stops for
their duration), so connecting is bounded by ``conn.connect`` and closing runs on a
background thread, after the calls in flight have ended, and only when the master answers.
"""

from __future__ import annotations

import functools
import threading
from concurrent.futures import ThreadPoolExecutor

from transfer.errors import StorageUnavailable
from transfer.log import get_logger
from transfer.storage.mooncake import conn
from transfer.storage.mooncake.buffers import BufferRegistry

log = get_logger(__name__)


def tracked(method):
    """Count the call as in flight, so ``close`` waits for it before closing the client."""
    @functools.wraps(method)
    def run(self, *args, **kwargs):
        with self._lock:
            self._inflight += 1
        try:
            return method(self, *args, **kwargs)
        finally:
            with self._lock:
                self._inflight -= 1
                if not self._inflight:
                    self._idle.notify_all()
    return run


class ClientSession:
    """Owns one ``MooncakeDistributedStore`` (``self._store``, None until connected), its buffer
    registry and put configuration, for a subclass that uses them.

    Args:
        settings: ``conn.MooncakeSettings``; ``lazy`` connects in the background.
    Raises:
        StorageUnavailable: not lazy, and ``conn.connect`` failed (bounded time).
    """

    def __init__(self, settings: conn.MooncakeSettings) -> None:
        self.settings = settings
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._inflight = 0
        self._idle = threading.Condition(self._lock)
        self._store = None
        self._buffers: BufferRegistry | None = None
        self._exists_pool = ThreadPoolExecutor(1, thread_name_prefix="kv-mooncake-exists")
        _, replicate_cls = conn.import_store()
        self._put_config = replicate_cls()
        self._put_config.replica_num = settings.replica_num
        if settings.preferred_segment and settings.preferred_segment != "local":
            self._put_config.preferred_segments = [settings.preferred_segment]
        if settings.lazy:
            threading.Thread(target=self._connect_forever, name="kv-mooncake-connect", daemon=True).start()
        else:
            self._attach(conn.connect(settings))

    def _attach(self, store) -> None:
        with self._lock:
            if self._closed.is_set():
                conn.close_quietly(store)
                return
            self._store, self._buffers = store, BufferRegistry(store)
            if self.settings.preferred_segment == "local" and self.settings.global_segment_size > 0:
                self._put_config.preferred_segments = [store.get_hostname()]  # this client's own segment
        log.info("mooncake.connected", master=self.settings.master, hostname=store.get_hostname())

    def _connect_forever(self) -> None:
        backoff = 0.5
        while not self._closed.is_set():
            try:
                self._attach(conn.connect(self.settings))
                return
            except StorageUnavailable as err:
                log.debug("mooncake.connect_retry", error=str(err), retry_in_s=backoff)
            self._closed.wait(backoff)
            backoff = min(backoff * 2, 30.0)

    @property
    def connected(self) -> bool:
        """Whether the client is set up (a lazy store connects in the background)."""
        return self._store is not None

    def close(self, wait: bool = False) -> None:
        """Stop taking calls at once; unregister buffers and close the client (its segment, and the
        objects placed only on it, go away). Idempotent; a lazy connection still being made is
        abandoned.

        Mooncake's client ``close`` holds the GIL: 1-2 s with the master up, ~17 s with it down.
        So it runs on a non-daemon thread after any stuck existence check ends (``wait=True``:
        on the caller's), and only when the master answers a TCP probe; otherwise the client is
        parked (never closed or destroyed, see ``conn.park``) rather than freeze the
        process."""
        with self._lock:
            if self._closed.is_set():
                return
            self._closed.set()
            store, buffers, self._store = self._store, self._buffers, None
        oplog = getattr(self, "_oplog", None)
        if oplog is not None:   # the summary of rate-limited per-page log lines
            oplog.flush()

        def finish() -> None:
            self._exists_pool.shutdown(wait=True, cancel_futures=True)
            with self._lock:  # reads and writes still running use the client: let them end
                self._idle.wait_for(lambda: not self._inflight, timeout=60)
            if buffers is not None:
                buffers.close()
            if store is not None:
                host, port = self.settings.host_port
                if conn.probe(host, port, self.settings.connect_timeout_s) is None:
                    conn.close_quietly(store)
                else:
                    conn.park(store, self.settings.master)

        if wait:
            finish()
        else:
            threading.Thread(target=finish, name="kv-mooncake-close", daemon=False).start()
