"""``KVEventPublisher`` over real ZMQ sockets: sequence numbers, the end marker, replay, bad endpoints."""

from __future__ import annotations

import hashlib
import math
import socket
import sys
import threading
import time

import pytest
import structlog
import zmq

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
            KVEventPublisher(endpoint, end_marker=False).close()
            return
        except KVEventsError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def _h(i: int) -> str:
    return hashlib.sha256(f"page{i}".encode()).hexdigest()


def test_batches_arrive_in_sequence_then_the_end_marker_and_replay_fills_a_late_join():
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
        sub.receive_until_end()          # batches missed while joining were replayed then
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
    pub = KVEventPublisher("tcp://127.0.0.1:0", replay_endpoint=rep_ep, flush_interval_s=0.01,
                           end_marker=False)
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
    pub = KVEventPublisher("tcp://127.0.0.1:0", end_marker=False)
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


def test_a_subscriber_that_saw_only_the_end_replays_everything_while_the_publisher_lingers():
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
        closer.start()                            # the end marker, then 5 s of replay
        sub.receive_until_end()
        assert sub.missing() == [] and sorted(sub.batches) == list(range(pub.stats().batches))
        assert pages_held(sub.batches, DISK) == {int64_id(_h(i)) for i in range(3)}
        closer.join()
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
    with pytest.raises(KVEventsError, match=f"flush_interval_s must be > 0, got {interval!r}"):
        KVEventPublisher("tcp://127.0.0.1:0", flush_interval_s=interval)


def test_without_pyzmq_the_error_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "zmq", None)   # ``import zmq`` raises ImportError
    with pytest.raises(KVEventsError, match=r"pip install 'kv-lifecycle\[events\]'"):
        KVEventPublisher("tcp://127.0.0.1:0")


def test_the_publisher_runs_on_one_daemon_thread_named_kv_events():
    before = set(threading.enumerate())
    pub = KVEventPublisher("tcp://127.0.0.1:0", end_marker=False)
    try:
        started = [t for t in threading.enumerate() if t not in before]
        assert [(t.name, t.daemon) for t in started] == [("kv-events", True)]   # never blocks the exit
        assert pub.replay_endpoint is None
    finally:
        pub.close()


def test_replay_keeps_the_last_buffer_steps_batches_stamped_with_the_rank():
    rep_ep = f"tcp://127.0.0.1:{_free_port()}"
    pub = KVEventPublisher("tcp://127.0.0.1:0", replay_endpoint=rep_ep, flush_interval_s=0.01,
                           end_marker=False, buffer_steps=2, attn_dp_rank=3)
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
    pub = KVEventPublisher("tcp://127.0.0.1:0", replay_endpoint=rep_ep, flush_interval_s=0.01,
                           end_marker=False)
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
    pub = KVEventPublisher("tcp://127.0.0.1:0", end_marker=False, flush_interval_s=0.01)
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
    pub = KVEventPublisher("tcp://127.0.0.1:0", end_marker=False, flush_interval_s=0.01)
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


def test_without_a_replay_socket_the_thread_ends_right_after_the_end_marker():
    pub = KVEventPublisher("tcp://127.0.0.1:0")          # no replay socket, no linger
    pub.close(timeout=0.5)
    assert not pub._thread.is_alive()                    # nothing to answer: it does not wait
