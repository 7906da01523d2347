"""``KVEventPublisher``: KV events on a ZMQ PUB socket in SGLang 0.5.19's wire format.

Producers (the scheduler, storage workers: any thread) never wait on a socket: an event is
encoded on the calling thread and appended to a bounded queue (``max_queue`` events); the publisher
thread alone owns the sockets. Every ``flush_interval_s`` the events queued so far go out as one
``KVEventBatch`` under the next sequence number, sent without blocking (``zmq.NOBLOCK``; a PUB
socket drops what a subscriber at its high-water mark cannot take, and that subscriber sees a gap
in the sequence numbers). An event offered to a full queue, or after ``close``, is dropped and
counted (``KVEventStats.dropped``), never queued. The publisher *binds* its endpoint (routers
connect). The last ``buffer_steps`` batches are kept for an optional replay socket (a ROUTER, as
SGLang's): a subscriber that sees a gap, or joined late, sends ``[b"", start_seq (8 bytes,
big-endian)]`` from a DEALER and gets every kept batch from there as ``[b"", seq, payload]``
frames, then ``[b"", END_SEQ, b""]``. The PUB socket carries batches only (no end marker: SGLang
sends ``END_SEQ`` on the replay socket alone). ``close`` sends what is queued, then answers
replays for ``replay_linger_s``.
"""

from __future__ import annotations

import itertools
import math
import numbers
import re
import threading
import time
from collections import deque

import msgspec

from transfer.errors import TransferError
from transfer.kv_events.wire import (
    END_SEQ, MEDIA, AllBlocksCleared, BlockRemoved, BlockStored, encode_event, hash_str_to_int64, join_batch,
)
from transfer.log import get_logger

log = get_logger(__name__)

_ENDPOINT = re.compile(r"(tcp://(\*|[A-Za-z0-9.\-]+|\[[0-9A-Fa-f:.]+\]):(\d{1,5})|ipc://.+|inproc://.+)\Z")
DROP_LOG_INTERVAL_S = 10.0   # at most one ``kv_events.dropped`` warning per this many seconds


class KVEventsError(TransferError, ValueError):
    """A bad publisher argument (a malformed endpoint, a bad number, a topic that is not a string),
    an endpoint that cannot be bound, or pyzmq missing."""


class KVEventStats(msgspec.Struct):
    """What a publisher sent: ``batches`` (the next sequence number), ``events`` in them,
    ``stored`` / ``removed`` page ids announced, ``queued`` events not sent yet, ``dropped`` events
    never queued (the queue was full, or the publisher closed), ``unsent`` batches the PUB socket
    refused without blocking (kept for replay: a subscriber sees the gap)."""

    batches: int = 0
    events: int = 0
    stored: int = 0
    removed: int = 0
    queued: int = 0
    dropped: int = 0
    unsent: int = 0


def check_endpoint(endpoint: str) -> str:
    """``endpoint`` if it is a ZMQ endpoint a publisher can bind: ``tcp://HOST:PORT`` (port
    0-65535; ``*`` for every interface; 0 picks a free port), ``ipc://PATH`` or ``inproc://NAME``.

    Raises:
        KVEventsError: anything else.
    """
    m = _ENDPOINT.match(endpoint) if isinstance(endpoint, str) else None
    if m is None or (m.group(3) is not None and int(m.group(3)) > 65535):
        raise KVEventsError(f"KV-event endpoint {endpoint!r}: expected tcp://HOST:PORT (port 0-65535), "
                            "ipc://PATH or inproc://NAME")
    return endpoint


def _seconds(name: str, value, *, positive: bool) -> float:
    """``value`` as seconds: a finite real number, > 0 (``positive``) or >= 0."""
    if not isinstance(value, numbers.Real) or isinstance(value, bool) or not math.isfinite(value) \
            or not (value > 0 if positive else value >= 0):
        raise KVEventsError(f"{name} must be a finite number {'> 0' if positive else '>= 0'}, got {value!r}")
    return float(value)


def _count(name: str, value, *, least: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < least:
        raise KVEventsError(f"{name} must be an integer >= {least}, got {value!r}")
    return value


class KVEventPublisher:
    """Publishes ``BlockStored`` / ``BlockRemoved`` events for a decode node's pages.

    Args:
        endpoint: the PUB endpoint to bind (``check_endpoint``), e.g. ``tcp://127.0.0.1:5557``.
        topic: the first frame of every message, a string (SGLang's default: empty).
        replay_endpoint: a ROUTER endpoint to bind for replay requests (None: no replay).
        attn_dp_rank: stamped on every batch (SGLang's data-parallel attention rank, >= 0; None: none).
        buffer_steps: batches kept for replay, >= 0.
        flush_interval_s: how long events wait to be batched, finite and > 0.
        replay_linger_s: after ``close`` has sent the last batch, keep answering replay requests
            this long, finite and >= 0 (a subscriber that finds a gap at the end still gets the
            batches it missed).
        max_queue: events queued at most; one more is dropped and counted, >= 1.
    Raises:
        KVEventsError: any argument above out of range or of the wrong type, an endpoint that
            cannot be bound (in use, no permission), or pyzmq not installed (the ``events``
            extra). Every argument is checked before a socket is made; on any error nothing is
            left bound.
    """

    def __init__(self, endpoint: str, *, topic: str = "", replay_endpoint: str | None = None,
                 attn_dp_rank: int | None = None, buffer_steps: int = 10_000, flush_interval_s: float = 0.05,
                 replay_linger_s: float = 0.0, max_queue: int = 100_000) -> None:
        check_endpoint(endpoint)
        if replay_endpoint is not None:
            check_endpoint(replay_endpoint)
        if not isinstance(topic, str):
            raise KVEventsError(f"topic must be a string, got {topic!r}")
        if attn_dp_rank is not None:
            _count("attn_dp_rank", attn_dp_rank, least=0)
        _count("buffer_steps", buffer_steps, least=0)
        _count("max_queue", max_queue, least=1)
        self._interval = _seconds("flush_interval_s", flush_interval_s, positive=True)
        self._linger = _seconds("replay_linger_s", replay_linger_s, positive=False)
        try:
            import zmq
        except ImportError as err:
            raise KVEventsError(f"KV events need pyzmq (pip install 'kv-lifecycle[events]'): {err}") from None
        self._zmq, self._ctx = zmq, zmq.Context.instance()
        self._pub = self._bind(zmq.PUB, endpoint)
        try:
            self._replay = None if replay_endpoint is None else self._bind(zmq.ROUTER, replay_endpoint)
        except BaseException:
            self._pub.close(linger=0)
            raise
        self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self.replay_endpoint = None if self._replay is None else self._replay.getsockopt_string(zmq.LAST_ENDPOINT)
        self._topic, self._rank, self._max_queue = topic.encode(), attn_dp_rank, max_queue
        # events from any thread: (encoded event, page ids stored, page ids removed); deque.append
        # is atomic, and bytes keep the queue out of the garbage collector's way
        self._queue: deque = deque()
        self._buffer: deque = deque(maxlen=buffer_steps)
        self._seq = itertools.count()
        self._stats = KVEventStats()
        self._lock = threading.Lock()        # the counters; never held around a socket call
        self._dropped = 0                    # under _lock
        self._sending = 0                    # under _lock: events taken from the queue, not yet counted sent
        self._logged_drops = 0               # the publisher thread's
        self._close_hooks: list = []
        self._closed = False                 # producers drop from here on
        self._closing = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="kv-events", daemon=True)
        self._thread.start()

    def _bind(self, kind: int, endpoint: str):
        sock = self._ctx.socket(kind)
        sock.setsockopt(self._zmq.LINGER, 1000)
        try:
            sock.bind(endpoint)
        except self._zmq.ZMQError as err:
            sock.close(linger=0)
            raise KVEventsError(f"cannot bind KV-event endpoint {endpoint!r}: {err}") from None
        return sock

    # -- producers (any thread; never touch a socket, never wait on the publisher thread) -------
    def stored(self, medium: str, page_hashes: list[str], token_ids: list[int], block_size: int,
               parent_hash: str | None = None) -> None:
        """Announce that pages ``page_hashes`` (chain order; ``token_ids`` their tokens, ``block_size``
        per page, or empty when unknown) are held in ``medium``; ``parent_hash`` is the page before.

        Raises:
            ValueError: an unknown medium, or a page hash without 16 leading hex digits (nothing
                is queued).
        """
        medium = _medium(medium)
        if not page_hashes:
            return
        ids = [hash_str_to_int64(h) for h in page_hashes]
        parent = None if parent_hash is None else hash_str_to_int64(parent_hash)
        self._offer(encode_event(BlockStored(ids, parent, list(token_ids), block_size, None, medium)), len(ids), 0)

    def removed(self, medium: str, page_hashes: list[str]) -> None:
        """Announce that pages ``page_hashes`` are no longer held in ``medium`` (errors: as ``stored``)."""
        medium = _medium(medium)
        if page_hashes:
            ids = [hash_str_to_int64(h) for h in page_hashes]
            self._offer(encode_event(BlockRemoved(ids, medium)), 0, len(ids))

    def cleared(self) -> None:
        """Announce that every page this publisher announced is gone."""
        self._offer(encode_event(AllBlocksCleared()), 0, 0)

    def _offer(self, payload: bytes, stored: int, removed: int) -> None:
        queue = self._queue
        if self._closed or len(queue) >= self._max_queue:
            with self._lock:
                self._dropped += 1
            return
        queue.append((payload, stored, removed))

    def add_close_hook(self, hook) -> None:
        """Call ``hook()`` at the start of ``close``, before the last batch is sent (an announcer
        hands over the events it still holds). Not called after ``close``."""
        if not self._closed:
            self._close_hooks.append(hook)

    def stats(self) -> KVEventStats:
        """A snapshot of what was sent, queued and dropped."""
        with self._lock:
            s = msgspec.structs.replace(self._stats)
            s.dropped = self._dropped
            s.queued = len(self._queue) + self._sending
        return s

    # -- the publisher thread -------------------------------------------------------------------
    def _loop(self) -> None:
        try:
            next_log = 0.0
            while not self._closing.is_set():
                self._serve_replay()
                self._flush()
                if time.monotonic() >= next_log and self._log_drops():
                    next_log = time.monotonic() + DROP_LOG_INTERVAL_S
                self._closing.wait(self._interval)
            self._flush()
            until = time.monotonic() + (self._linger if self._replay is not None else 0.0)
            while True:
                self._serve_replay()
                if time.monotonic() >= until:
                    break
                time.sleep(0.005)
        except Exception as err:  # a socket error must not kill the scheduler; it is reported once
            log.error("kv_events.publisher_failed", error=repr(err))

    def _log_drops(self) -> bool:
        """Warn of events dropped since the last warning; True if it did."""
        with self._lock:
            dropped = self._dropped
        if dropped == self._logged_drops:
            return False
        log.warning("kv_events.dropped", dropped=dropped, since_last=dropped - self._logged_drops,
                    closed=self._closed, max_queue=self._max_queue)
        self._logged_drops = dropped
        return True

    def _flush(self) -> None:
        items = []
        queue = self._queue
        with self._lock:         # taken from the queue, counted as queued until counted as sent
            while queue:
                items.append(queue.popleft())
            self._sending = len(items)
        if not items:
            return
        payload = join_batch(time.time(), [e for e, _, _ in items], self._rank)
        seq = next(self._seq)
        seq_bytes = seq.to_bytes(8, "big")
        self._buffer.append((seq_bytes, payload))
        try:
            self._pub.send_multipart((self._topic, seq_bytes, payload), flags=self._zmq.NOBLOCK)
            unsent = 0
        except self._zmq.Again:      # never waits: the batch stays for replay, the subscriber sees a gap
            unsent = 1
        with self._lock:
            self._sending = 0
            self._stats.batches = seq + 1
            self._stats.events += len(items)
            self._stats.stored += sum(n for _, n, _ in items)
            self._stats.removed += sum(n for _, _, n in items)
            self._stats.unsent += unsent

    def _serve_replay(self) -> None:
        sock = self._replay
        zmq = self._zmq
        while sock is not None and sock.poll(0):
            frames = sock.recv_multipart()
            if len(frames) != 3 or len(frames[2]) != 8:
                log.warning("kv_events.bad_replay_request", frames=len(frames))
                continue
            client, start = frames[0], int.from_bytes(frames[2], "big")
            try:
                for seq_bytes, payload in list(self._buffer):
                    if int.from_bytes(seq_bytes, "big") >= start:
                        sock.send_multipart((client, b"", seq_bytes, payload), flags=zmq.NOBLOCK)
                sock.send_multipart((client, b"", END_SEQ, b""), flags=zmq.NOBLOCK)
            except zmq.Again:        # a replay client that does not read is not waited for
                log.warning("kv_events.replay_dropped", start=start)

    def close(self, timeout: float = 2.0) -> None:
        """Hand over what announcers hold (``add_close_hook``), send what is queued, answer replays
        for ``replay_linger_s``, and close the sockets, waiting at most ``timeout`` seconds (plus
        the linger) for the publisher thread. From here on ``stored`` / ``removed`` / ``cleared``
        queue nothing: each event is dropped and counted in ``stats().dropped``. Idempotent.

        Raises:
            KVEventsError: ``timeout`` not a finite number >= 0 (nothing is closed).
        """
        timeout = _seconds("timeout", timeout, positive=False)
        if self._closing.is_set():
            return
        hooks, self._close_hooks = self._close_hooks, []
        for hook in hooks:
            try:
                hook()
            except Exception as err:  # the publisher still closes
                log.error("kv_events.close_hook_failed", error=repr(err))
        self._closed = True
        self._closing.set()
        self._thread.join(timeout + self._linger)
        if not self._thread.is_alive():
            left = 0
            while self._queue:       # offered while closing, after the last batch: dropped
                self._queue.popleft()
                left += 1
            with self._lock:
                self._dropped += left
            self._log_drops()
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close(linger=int(timeout * 1000))


def _medium(medium: str) -> str:
    if medium not in MEDIA:
        raise ValueError(f"medium {medium!r} is not one of {MEDIA}")
    return medium
