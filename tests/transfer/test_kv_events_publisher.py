"""``KVEventPublisher`` over real ZMQ sockets: sequence numbers, batches only on the PUB socket (SGLang's
subscriber decodes every message), replay, producers that never wait on a socket (a full queue and a
closed publisher drop and count), arguments checked before anything is bound."""

from __future__ import annotations

import hashlib
import logging
import math
import socket
import sys
import threading
import time

import pytest
import structlog
import zmq

from tests.data.sglang_0_5_19_kv_events import BlockStored, KVEventsSubscriber
from tests.data.sglang_0_5_19_kv_events import logger as sglang_logger
from tests.support.kv_subscriber import Subscriber, events, int64_id, pages_held
from transfer.kv_events import CPU_PINNED, DISK, KVEventPublisher, KVEventsError, check_endpoint


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait(cond, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError("condition not reached")
        time.sleep(0.002)


def assert_bindable(endpoint: str, timeout_s: float = 10.0) -> None:
    """``endpoint`` can be bound again (ZMQ releases a closed socket's bind in its I/O thread, soon
    after ``close``: retried until then)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            KVEventPublisher(endpoint).close()
            return
        except KVEventsError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def _h(i: int) -> str:
    return hashlib.sha256(f"page{i}".encode()).hexdigest()


def test_batches_arrive_in_sequence_and_replay_fills_a_late_join():
    pub_ep, rep_ep = f"tcp://127.0.0.1:{_free_port()}", f"tcp://127.0.0.1:{_free_port()}"
    sub = Subscriber(pub_ep, rep_ep)     # connects before the publisher binds
    pub = KVEventPublisher(pub_ep, replay_endpoint=rep_ep, flush_interval_s=0.01)
    try:
        pub.cleared()                    # until the subscription is live, batches are dropped:
        while not sub.sub.poll(20):      # keep a batch coming until one arrives
            pub.cleared()
        sub.pump()                       # a gap before it is replayed now, while the publisher runs
        assert sub.missing() == [] and min(sub.batches) == 0
        for i in range(50):
            pub.stored(DISK, [_h(i)], list(range(i, i + 4)), 4, _h(i - 1) if i else None)
            if i % 5 == 4:
                pub.removed(DISK, [_h(i - 4)])
        pub.close()
        sub.receive_until(pub.stats().batches)   # batches missed while joining were replayed then
        assert sub.missing() == [] and min(sub.batches) == 0
        assert max(sub.batches) + 1 == pub.stats().batches
        stored = [e for e in events(sub.batches) if e[0] == "BlockStored"]
        assert [e[1] for e in stored] == [[int64_id(_h(i))] for i in range(50)]
        assert stored[0][2] is None and all(e[2] == int64_id(_h(i - 1)) for i, e in enumerate(stored) if i)
        assert stored[3][3] == [3, 4, 5, 6] and stored[3][4] == 4
        want = {int64_id(_h(i)) for i in range(50)} - {int64_id(_h(i - 4)) for i in range(4, 50, 5)}
        assert pages_held(sub.batches, DISK) == want and pages_held(sub.batches, CPU_PINNED) == set()
        s = pub.stats()
        assert (s.stored, s.removed, s.queued) == (50, 10, 0)
    finally:
        pub.close()
        sub.close()


def test_replay_from_the_middle_returns_only_later_batches():
    rep_ep = f"tcp://127.0.0.1:{_free_port()}"
    pub = KVEventPublisher("tcp://127.0.0.1:0", replay_endpoint=rep_ep, flush_interval_s=0.01)
    try:
        sub = Subscriber(pub.endpoint, rep_ep)
        for i in range(3):
            pub.stored(DISK, [_h(i)], [], 4)
            _wait(lambda i=i: pub.stats().batches == i + 1)   # one batch per event
        assert sub.fill_from_replay(1) == 2 and sorted(sub.batches) == [1, 2]
        assert pub.replay_endpoint == rep_ep and pub.stats().events == 3
        sub.close()
    finally:
        pub.close()


@pytest.mark.parametrize("endpoint", ["", "tcp://127.0.0.1", "tcp://127.0.0.1:70000", "http://x:1",
                                      "tcp://a b:5", "127.0.0.1:5557", None, 5557])
def test_a_malformed_endpoint_is_a_typed_error(endpoint):
    with pytest.raises(KVEventsError, match=r"expected tcp://HOST:PORT \(port 0-65535\), ipc://PATH or inproc://NAME"):
        check_endpoint(endpoint)
    with pytest.raises(KVEventsError):
        KVEventPublisher(endpoint)


def test_an_endpoint_in_use_is_a_typed_error_and_leaves_nothing_bound():
    first = KVEventPublisher("tcp://127.0.0.1:0")
    try:
        with pytest.raises(KVEventsError, match="cannot bind"):
            KVEventPublisher(first.endpoint)
        port = _free_port()
        with pytest.raises(KVEventsError, match="cannot bind"):   # the replay socket fails: PUB released
            KVEventPublisher(f"tcp://127.0.0.1:{port}", replay_endpoint=first.endpoint)
        assert_bindable(f"tcp://127.0.0.1:{port}")
    finally:
        first.close()


def test_an_unknown_medium_is_refused_before_anything_is_queued():
    pub = KVEventPublisher("tcp://127.0.0.1:0")
    try:
        with pytest.raises(ValueError, match="medium 'SSD' is not one of"):
            pub.stored("SSD", [_h(1)], [], 4)
        assert pub.stats().queued == 0
    finally:
        pub.close()


def test_close_is_idempotent_and_the_socket_is_released():
    pub = KVEventPublisher("tcp://127.0.0.1:0")
    ep = pub.endpoint
    pub.close()
    pub.close()
    assert_bindable(ep)


def test_a_subscriber_that_finds_a_gap_in_the_last_batch_replays_everything_while_the_publisher_lingers():
    rep_ep = f"tcp://127.0.0.1:{_free_port()}"
    pub = KVEventPublisher("tcp://127.0.0.1:0", replay_endpoint=rep_ep, flush_interval_s=0.01,
                           replay_linger_s=5.0)
    for i in range(3):
        pub.stored(DISK, [_h(i)], [], 4)
    _wait(lambda: pub.stats().stored == 3)        # sent before anyone subscribed: lost to a subscriber
    sub = Subscriber(pub.endpoint, rep_ep)
    try:
        closer = threading.Thread(target=pub.close)
        while not sub.sub.poll(20):               # until the subscription is live (a page never stored)
            pub.removed(DISK, [_h(99)])
        _wait(lambda: pub.stats().queued == 0)
        while sub.sub.poll(200):                  # drop what arrived: this subscriber "saw nothing"
            sub.sub.recv_multipart()
        pub.stored(DISK, [_h(3)], [], 4)          # the last batch, sent by the loop or by close
        closer.start()                            # then 5 s of replay
        assert sub.sub.poll(30_000), "no last batch"
        sub.pump()                                # the last batch; the gap before it replayed now
        closer.join()
        assert sub.missing() == [] and sorted(sub.batches) == list(range(pub.stats().batches))
        assert pages_held(sub.batches, DISK) == {int64_id(_h(i)) for i in range(4)}
    finally:
        pub.close()
        sub.close()


def test_a_negative_linger_is_refused():
    with pytest.raises(KVEventsError, match="replay_linger_s"):
        KVEventPublisher("tcp://127.0.0.1:0", replay_linger_s=-1)


def test_the_port_range_ends_at_65535():
    assert check_endpoint("tcp://127.0.0.1:65535") == "tcp://127.0.0.1:65535"
    with pytest.raises(KVEventsError, match="65536"):
        check_endpoint("tcp://127.0.0.1:65536")


@pytest.mark.parametrize("interval", [0, -0.5, math.nan])
def test_a_flush_interval_that_is_not_positive_is_refused(interval):
    with pytest.raises(KVEventsError, match=f"flush_interval_s must be a finite number > 0, got {interval!r}"):
        KVEventPublisher("tcp://127.0.0.1:0", flush_interval_s=interval)


def test_without_pyzmq_the_error_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "zmq", None)   # ``import zmq`` raises ImportError
    with pytest.raises(KVEventsError, match=r"pip install 'kv-lifecycle\[events\]'"):
        KVEventPublisher("tcp://127.0.0.1:0")


def test_the_publisher_runs_on_one_daemon_thread_named_kv_events():
    before = set(threading.enumerate())
    pub = KVEventPublisher("tcp://127.0.0.1:0")
    try:
        started = [t for t in threading.enumerate() if t not in before]
        assert [(t.name, t.daemon) for t in started] == [("kv-events", True)]   # never blocks the exit
        assert pub.replay_endpoint is None
    finally:
        pub.close()


def test_replay_keeps_the_last_buffer_steps_batches_stamped_with_the_rank():
    rep_ep = f"tcp://127.0.0.1:{_free_port()}"
    pub = KVEventPublisher("tcp://127.0.0.1:0", replay_endpoint=rep_ep, flush_interval_s=0.01,
                           buffer_steps=2, attn_dp_rank=3)
    try:
        for i in range(4):
            pub.stored(DISK, [_h(i)], [], 4)
            _wait(lambda i=i: pub.stats().batches == i + 1)
        sub = Subscriber(pub.endpoint, rep_ep)
        assert sub.fill_from_replay(0) == 2 and sorted(sub.batches) == [2, 3]   # 0 and 1 were dropped
        assert {b[2] for b in sub.batches.values()} == {3}
        assert [e[1] for e in events(sub.batches)] == [[int64_id(_h(2))], [int64_id(_h(3))]]
        assert pub.stats().events == 4
        sub.close()
    finally:
        pub.close()


def test_a_bad_replay_request_is_logged_and_unanswered_and_the_next_one_is_served():
    rep_ep = f"tcp://127.0.0.1:{_free_port()}"
    pub = KVEventPublisher("tcp://127.0.0.1:0", replay_endpoint=rep_ep, flush_interval_s=0.01)
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(rep_ep)
    try:
        pub.stored(DISK, [_h(0)], [], 4)
        _wait(lambda: pub.stats().batches == 1)
        with structlog.testing.capture_logs() as logs:
            dealer.send_multipart((b"", b"abc"))               # a start that is not 8 bytes
            dealer.send_multipart((b"x",))                     # too few frames
            dealer.send_multipart((b"", (0).to_bytes(8, "big")))
            replies = []
            while not replies or replies[-1][1] != (-1).to_bytes(8, "big", signed=True):
                assert dealer.poll(30_000), "no replay answer"
                replies.append(dealer.recv_multipart())
        assert [r[1] for r in replies] == [(0).to_bytes(8, "big"), (-1).to_bytes(8, "big", signed=True)]
        bad = [(e["event"], e["log_level"], e["frames"]) for e in logs if "frames" in e]
        assert bad == [("kv_events.bad_replay_request", "warning", 3),
                       ("kv_events.bad_replay_request", "warning", 2)]
    finally:
        dealer.close()
        pub.close()


class _Boom(zmq.ZMQError):
    pass


def test_a_socket_error_stops_the_publisher_thread_with_one_logged_error():
    pub = KVEventPublisher("tcp://127.0.0.1:0", flush_interval_s=0.01)
    sock = pub._pub

    def fail(*_args, **_kw):
        raise _Boom(errno=zmq.ETERM, msg="socket gone")

    sock.send_multipart = fail
    try:
        with structlog.testing.capture_logs() as logs:
            pub.cleared()
            pub._thread.join(30)
        assert not pub._thread.is_alive()       # the scheduler is not touched; the thread ends
        failed = [e for e in logs if e["log_level"] == "error"]
        assert [(e["event"], "socket gone" in e["error"]) for e in failed] == [("kv_events.publisher_failed", True)]
    finally:
        del sock.send_multipart
        pub.close()


def test_close_waits_at_most_its_timeout_for_a_blocked_publisher_thread():
    pub = KVEventPublisher("tcp://127.0.0.1:0", flush_interval_s=0.01)
    sock, gate, entered = pub._pub, threading.Event(), threading.Event()

    def blocked(*_args, **_kw):
        entered.set()
        gate.wait(60)

    sock.send_multipart = blocked
    try:
        pub.cleared()
        assert entered.wait(30)
        closer = threading.Thread(target=pub.close, kwargs={"timeout": 0.2})
        closer.start()
        closer.join(20)
        assert not closer.is_alive() and pub._thread.is_alive()   # returned; the thread is still stuck
    finally:
        gate.set()
        pub._thread.join(30)
        del sock.send_multipart


def test_without_a_replay_socket_close_does_not_linger():
    pub = KVEventPublisher("tcp://127.0.0.1:0", replay_linger_s=60.0)   # the linger serves replays only
    closer = threading.Thread(target=pub.close, kwargs={"timeout": 0.8})
    closer.start()
    closer.join(20)
    assert not closer.is_alive() and not pub._thread.is_alive()


def test_without_a_replay_socket_the_thread_ends_right_after_the_last_batch():
    pub = KVEventPublisher("tcp://127.0.0.1:0")          # no replay socket, no linger
    pub.close(timeout=0.5)
    assert not pub._thread.is_alive()                    # nothing to answer: it does not wait


# -- the PUB socket carries batches only (issue 35.3) ------------------------------------------------
def test_the_pub_socket_carries_batches_only_and_sglangs_subscriber_decodes_every_message(caplog):
    """SGLang sends ``END_SEQ`` on the replay socket only; on the PUB socket every message is a
    batch. SGLang 0.5.19's own subscriber (copied verbatim) decodes everything a publisher sends,
    its close included, without logging an error."""
    caplog.set_level(logging.INFO, logger=sglang_logger.name)
    pub = KVEventPublisher("tcp://127.0.0.1:0", flush_interval_s=0.01)
    theirs = KVEventsSubscriber(pub.endpoint, poll_timeout_ms=20)
    ours = Subscriber(pub.endpoint)
    theirs.start()
    try:
        while not (theirs.received and ours.batches):   # until both subscriptions are live
            pub.cleared()
            time.sleep(0.02)
            ours.pump()
        first = min(ours.batches)
        for i in range(20):
            pub.stored(DISK, [_h(i)], [i], 1, _h(i - 1) if i else None)
        pub.close()
        ours.receive_until(pub.stats().batches)          # every batch from the first it saw ...
        while ours.sub.poll(500):                        # ... and nothing after the last: no seq -1
            ours.pump()
        assert sorted(ours.batches) == list(range(first, pub.stats().batches))
        _wait(lambda: sum(isinstance(e, BlockStored) for e, _, _ in theirs.received) == 20)
    finally:
        theirs.stop()
        ours.close()
        pub.close()
    assert [e.block_hashes for e, _, _ in theirs.received if isinstance(e, BlockStored)] == \
        [[int64_id(_h(i))] for i in range(20)]
    assert [r for r in caplog.records if r.name == sglang_logger.name and r.levelno >= logging.WARNING] == []


# -- producers never wait on a socket (issue 35.4) ---------------------------------------------------
class _Spy:
    """A real socket whose calls are recorded with the calling thread and the send flags (a spy:
    every call goes to the socket)."""

    def __init__(self, sock) -> None:
        self._sock, self.calls = sock, []

    def __getattr__(self, name):
        attr = getattr(self._sock, name)
        if not callable(attr):
            return attr

        def call(*args, **kwargs):
            self.calls.append((threading.current_thread().name, name, kwargs.get("flags", 0)))
            return attr(*args, **kwargs)
        return call


def _stuck_subscriber(endpoint: str):
    """A real SUB socket (receive high-water mark 10) that never reads."""
    sock = zmq.Context.instance().socket(zmq.SUB)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVHWM, 10)
    sock.connect(endpoint)
    sock.setsockopt(zmq.SUBSCRIBE, b"")
    return sock


def test_a_subscriber_that_never_reads_holds_up_neither_producers_nor_the_publisher_thread():
    """Producers never touch a socket: every socket call is the publisher thread's, and every send
    is non-blocking, so 20,000 events past a subscriber that never reads all go out (what that
    subscriber cannot take, the PUB socket drops: it sees a gap, and can replay)."""
    pub = KVEventPublisher("tcp://127.0.0.1:0", flush_interval_s=0.001)
    stuck = _stuck_subscriber(pub.endpoint)
    spy = pub._pub = _Spy(pub._pub)
    try:
        for i in range(20_000):
            pub.stored(DISK, [_h(i)], [i], 1, _h(i - 1) if i else None)
            if i % 1000 == 0:
                pub.removed(DISK, [_h(i)])
        _wait(lambda: pub.stats().queued == 0)           # the publisher thread was never held up
        calls = list(spy.calls)
        s = pub.stats()
        assert (s.events, s.stored, s.removed, s.dropped, s.unsent) == (20_020, 20_000, 20, 0, 0)
        assert {thread for thread, _, _ in calls} == {"kv-events"}
        sends = [flags for _, name, flags in calls if name.startswith("send")]
        assert len(sends) == s.batches and all(flags & zmq.NOBLOCK for flags in sends)
    finally:
        pub.close()
        stuck.close()


def _block_sends(pub):
    """Hold the publisher thread inside its next send until ``gate`` is set (then send for real)."""
    sock, gate, entered = pub._pub, threading.Event(), threading.Event()
    send = sock.send_multipart

    def blocked(*args, **kwargs):
        entered.set()
        gate.wait(60)
        return send(*args, **kwargs)

    sock.send_multipart = blocked
    return sock, gate, entered


def test_a_full_queue_drops_new_events_counts_and_logs_them_while_the_producer_goes_on():
    pub = KVEventPublisher("tcp://127.0.0.1:0", flush_interval_s=0.01, max_queue=100)
    stuck = _stuck_subscriber(pub.endpoint)
    sock, gate, entered = _block_sends(pub)
    try:
        pub.cleared()
        assert entered.wait(30)                          # the publisher thread is inside a send
        producer = threading.Thread(target=lambda: [pub.stored(DISK, [_h(i)], [], 4) for i in range(150)])
        producer.start()
        producer.join(60)
        assert not producer.is_alive()                   # it returned while the send still hangs
        s = pub.stats()
        assert (s.queued, s.dropped, s.events) == (1 + 100, 50, 0)   # in the hung send + the bound; drops counted
        with structlog.testing.capture_logs() as logs:
            gate.set()
            _wait(lambda: pub.stats().events == 101 and any(e["event"] == "kv_events.dropped" for e in logs))
        s = pub.stats()
        assert (s.events, s.stored, s.dropped) == (101, 100, 50)
        dropped = [e for e in logs if e["event"] == "kv_events.dropped"]
        assert [(e["log_level"], e["dropped"], e["max_queue"]) for e in dropped] == [("warning", 50, 100)]
    finally:
        gate.set()
        del sock.send_multipart
        pub.close()
        stuck.close()


def test_a_batch_the_pub_socket_refuses_is_counted_unsent_and_kept_for_replay():
    rep_ep = f"tcp://127.0.0.1:{_free_port()}"
    pub = KVEventPublisher("tcp://127.0.0.1:0", replay_endpoint=rep_ep, flush_interval_s=0.01)
    sock, flags = pub._pub, []

    def refuse(*_args, **kwargs):
        flags.append(kwargs.get("flags", 0))
        raise zmq.Again()

    sock.send_multipart = refuse
    try:
        pub.stored(DISK, [_h(0)], [], 4)
        _wait(lambda: pub.stats().batches == 1)
        assert pub.stats().unsent == 1 and flags == [zmq.NOBLOCK] and pub._thread.is_alive()
        sub = Subscriber(pub.endpoint, rep_ep)
        assert sub.fill_from_replay(0) == 1                # the gap a subscriber sees: replayable
        assert pages_held(sub.batches, DISK) == {int64_id(_h(0))}
        sub.close()
    finally:
        del sock.send_multipart
        pub.close()


# -- arguments before sockets, and after close (issue 35.5) ------------------------------------------
BAD_ARGUMENTS = [
    ("buffer_steps", -1), ("buffer_steps", 1.5), ("buffer_steps", True), ("topic", None), ("topic", b"t"),
    ("attn_dp_rank", -1), ("attn_dp_rank", "0"), ("flush_interval_s", math.inf), ("flush_interval_s", "0.1"),
    ("replay_linger_s", math.inf), ("replay_linger_s", math.nan), ("replay_linger_s", -1),
    ("replay_linger_s", "1"), ("max_queue", 0), ("max_queue", 2.0),
]


@pytest.mark.parametrize("name, value", BAD_ARGUMENTS)
def test_a_bad_argument_is_a_typed_error_before_any_socket_is_bound(name, value):
    pub_port, replay_port = _free_port(), _free_port()
    before = set(threading.enumerate())
    with pytest.raises(KVEventsError, match=name):
        KVEventPublisher(f"tcp://127.0.0.1:{pub_port}", replay_endpoint=f"tcp://127.0.0.1:{replay_port}",
                         **{name: value})
    assert set(threading.enumerate()) <= before          # no publisher thread
    for port in (pub_port, replay_port):                 # never bound: free at once, no retry
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


@pytest.mark.parametrize("timeout", [math.inf, math.nan, -1, "1"])
def test_close_with_a_bad_timeout_is_a_typed_error_and_closes_nothing(timeout):
    pub = KVEventPublisher("tcp://127.0.0.1:0", replay_endpoint="tcp://127.0.0.1:0", flush_interval_s=0.01)
    try:
        with pytest.raises(KVEventsError, match="timeout must be a finite number >= 0"):
            pub.close(timeout=timeout)
        pub.stored(DISK, [_h(0)], [], 4)
        _wait(lambda: pub.stats().stored == 1)           # still publishing
    finally:
        pub.close()
    assert_bindable(pub.endpoint)
    assert_bindable(pub.replay_endpoint)


def test_after_close_every_producer_call_is_a_counted_drop():
    pub = KVEventPublisher("tcp://127.0.0.1:0")
    pub.stored(DISK, [_h(0)], [], 4)
    pub.close()
    sent = pub.stats()
    assert (sent.events, sent.queued, sent.dropped) == (1, 0, 0)
    for i in range(50_000):
        pub.stored(DISK, [_h(i)], [], 4)
    pub.removed(DISK, [_h(1)])
    pub.cleared()
    s = pub.stats()
    assert (s.queued, s.dropped, s.events, s.batches) == (0, 50_002, 1, sent.batches)   # held nowhere
    with pytest.raises(ValueError, match="medium 'SSD'"):   # a bad call is still refused first
        pub.stored("SSD", [_h(0)], [], 4)
    assert pub.stats().dropped == 50_002
