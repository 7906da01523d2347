"""``KVEventPublisher``: KV events on a ZMQ PUB socket in SGLang 0.5.19's wire format.

Events are queued by any thread (the scheduler, storage workers) without blocking and sent by one
publisher thread, which owns the sockets: every ``flush_interval_s`` the events queued so far go
out as one ``KVEventBatch`` under the next sequence number. The publisher *binds* its endpoint
(routers connect). The last ``buffer_steps`` batches are kept for an optional replay socket (a
ROUTER, as SGLang's): a subscriber that sees a gap in the sequence numbers, or joined late, sends
``[b"", start_seq (8 bytes, big-endian)]`` from a DEALER and gets every kept batch from there as
``[b"", seq, payload]`` frames, then ``[b"", END_SEQ, b""]``. ``close`` sends what is queued and
then, unless ``end_marker=False``, ``(topic, END_SEQ, b"")`` on the PUB socket: the end of the run.
"""

from __future__ import annotations

import itertools
import re
import threading
import time
from collections import deque

import msgspec

from transfer.errors import TransferError
from transfer.kv_events.wire import (
    END_SEQ, MEDIA, AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch, encode_batch,
    hash_str_to_int64,
)
from transfer.log import get_logger

log = get_logger(__name__)

_ENDPOINT = re.compile(r"(tcp://(\*|[A-Za-z0-9.\-]+|\[[0-9A-Fa-f:.]+\]):(\d{1,5})|ipc://.+|inproc://.+)\Z")


class KVEventsError(TransferError, ValueError):
    """A KV-event endpoint that is malformed or cannot be bound, or pyzmq missing."""


class KVEventStats(msgspec.Struct):
    """What a publisher sent: ``batches`` (the next sequence number), ``events`` in them,
    ``stored`` / ``removed`` page ids announced, ``queued`` events not sent yet."""

    batches: int = 0
    events: int = 0
    stored: int = 0
    removed: int = 0
    queued: int = 0


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


class KVEventPublisher:
    """Publishes ``BlockStored`` / ``BlockRemoved`` events for a decode node's pages.

    Args:
        endpoint: the PUB endpoint to bind (``check_endpoint``), e.g. ``tcp://127.0.0.1:5557``.
        topic: the first frame of every message (SGLang's default: empty).
        replay_endpoint: a ROUTER endpoint to bind for replay requests (None: no replay).
        attn_dp_rank: stamped on every batch (SGLang's data-parallel attention rank; None: none).
        buffer_steps: batches kept for replay.
        flush_interval_s: how long events wait to be batched, > 0.
        end_marker: send ``(topic, END_SEQ, b"")`` on close.
        replay_linger_s: after the end marker, keep answering replay requests this long (a
            subscriber that sees the end with a gap still gets the batches it missed).
    Raises:
        KVEventsError: a malformed endpoint, one that cannot be bound (in use, no permission), a
            bad interval, or pyzmq not installed (the ``events`` extra). Nothing is left bound.
    """

    def __init__(self, endpoint: str, *, topic: str = "", replay_endpoint: str | None = None,
                 attn_dp_rank: int | None = None, buffer_steps: int = 10_000, flush_interval_s: float = 0.05,
                 end_marker: bool = True, replay_linger_s: float = 0.0) -> None:
        check_endpoint(endpoint)
        if replay_endpoint is not None:
            check_endpoint(replay_endpoint)
        if not flush_interval_s > 0:
            raise KVEventsError(f"flush_interval_s must be > 0, got {flush_interval_s!r}")
        if not replay_linger_s >= 0:
            raise KVEventsError(f"replay_linger_s must be >= 0, got {replay_linger_s!r}")
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
        self._topic, self._rank, self._end_marker = topic.encode(), attn_dp_rank, end_marker
        self._interval, self._linger = flush_interval_s, replay_linger_s
        self._queue: deque = deque()  # events from any thread (deque.append is atomic)
        self._buffer: deque = deque(maxlen=buffer_steps)
        self._seq = itertools.count()
        self._stats = KVEventStats()
        self._lock = threading.Lock()
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

    # -- producers (any thread) -----------------------------------------------------------------
    def stored(self, medium: str, page_hashes: list[str], token_ids: list[int], block_size: int,
               parent_hash: str | None = None) -> None:
        """Announce that pages ``page_hashes`` (chain order; ``token_ids`` their tokens, ``block_size``
        per page, or empty when unknown) are held in ``medium``; ``parent_hash`` is the page before."""
        if not page_hashes:
            return
        ids = [hash_str_to_int64(h) for h in page_hashes]
        parent = None if parent_hash is None else hash_str_to_int64(parent_hash)
        self._queue.append(BlockStored(ids, parent, list(token_ids), block_size, None, _medium(medium)))

    def removed(self, medium: str, page_hashes: list[str]) -> None:
        """Announce that pages ``page_hashes`` are no longer held in ``medium``."""
        if page_hashes:
            self._queue.append(BlockRemoved([hash_str_to_int64(h) for h in page_hashes], _medium(medium)))

    def cleared(self) -> None:
        """Announce that every page this publisher announced is gone."""
        self._queue.append(AllBlocksCleared())

    def stats(self) -> KVEventStats:
        """A snapshot of what was sent."""
        with self._lock:
            s = msgspec.structs.replace(self._stats)
        s.queued = len(self._queue)
        return s

    # -- the publisher thread -------------------------------------------------------------------
    def _loop(self) -> None:
        try:
            while not self._closing.is_set():
                self._serve_replay()
                self._flush()
                self._closing.wait(self._interval)
            self._flush()
            if self._end_marker:
                self._pub.send_multipart((self._topic, END_SEQ, b""))
            until = time.monotonic() + (self._linger if self._replay is not None else 0.0)
            while True:
                self._serve_replay()
                if time.monotonic() >= until:
                    break
                time.sleep(0.005)
        except Exception as err:  # a socket error must not kill the scheduler; it is reported once
            log.error("kv_events.publisher_failed", error=repr(err))

    def _flush(self) -> None:
        events = []
        queue = self._queue
        while queue:
            events.append(queue.popleft())
        if not events:
            return
        payload = encode_batch(KVEventBatch(time.time(), events, self._rank))
        seq = next(self._seq)
        seq_bytes = seq.to_bytes(8, "big")
        self._pub.send_multipart((self._topic, seq_bytes, payload))
        self._buffer.append((seq_bytes, payload))
        with self._lock:
            self._stats.batches = seq + 1
            self._stats.events += len(events)
            for e in events:
                if isinstance(e, BlockStored):
                    self._stats.stored += len(e.block_hashes)
                elif isinstance(e, BlockRemoved):
                    self._stats.removed += len(e.block_hashes)

    def _serve_replay(self) -> None:
        sock = self._replay
        while sock is not None and sock.poll(0):
            frames = sock.recv_multipart()
            if len(frames) != 3 or len(frames[2]) != 8:
                log.warning("kv_events.bad_replay_request", frames=len(frames))
                continue
            client, start = frames[0], int.from_bytes(frames[2], "big")
            for seq_bytes, payload in list(self._buffer):
                if int.from_bytes(seq_bytes, "big") >= start:
                    sock.send_multipart((client, b"", seq_bytes, payload))
            sock.send_multipart((client, b"", END_SEQ, b""))

    def close(self, timeout: float = 2.0) -> None:
        """Send what is queued (then the end marker), answer replays for ``replay_linger_s``, and
        close the sockets, waiting at most ``timeout`` seconds (plus the linger) for the publisher
        thread. Idempotent."""
        if self._closing.is_set():
            return
        self._closing.set()
        self._thread.join(timeout + self._linger)
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close(linger=int(timeout * 1000))


def _medium(medium: str) -> str:
    if medium not in MEDIA:
        raise ValueError(f"medium {medium!r} is not one of {MEDIA}")
    return medium
