"""``KVEventPublisher`` over real ZMQ sockets: sequence numbers, the end marker, replay, bad endpoints."""

from __future__ import annotations

import hashlib
import socket
import threading
import time

import pytest

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
        sub.close()
    finally:
        pub.close()


@pytest.mark.parametrize("endpoint", ["", "tcp://127.0.0.1", "tcp://127.0.0.1:70000", "http://x:1",
                                      "tcp://a b:5", "127.0.0.1:5557", None, 5557])
def test_a_malformed_endpoint_is_a_typed_error(endpoint):
    with pytest.raises(KVEventsError):
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
        with pytest.raises(ValueError):
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
