"""A KV-event subscriber written from the wire format (SGLang 0.5.19 ``kv_events.py``), not from our
structs: a real ZMQ SUB socket, frames ``(topic, seq 8-byte big-endian, msgpack payload)``, payloads
decoded as plain msgpack arrays, gaps filled from the replay ROUTER. ``seq == -1`` ends a replay
answer and nothing else: on the PUB socket it is an error (SGLang's subscriber fails to decode it).
A run's end is known out of band (``receive_until`` the publisher's batch count).
"""

from __future__ import annotations

import time

import msgspec
import zmq

END = (-1).to_bytes(8, "big", signed=True)


class Subscriber:
    """Connects before the publisher binds (ZMQ retries), so it can be started first."""

    def __init__(self, endpoint: str, replay: str | None = None, topic: bytes = b"") -> None:
        self.ctx = zmq.Context.instance()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.LINGER, 0)
        self.sub.connect(endpoint)
        self.sub.setsockopt(zmq.SUBSCRIBE, topic)
        self.replay_endpoint, self.topic = replay, topic
        self.batches: dict[int, list] = {}   # seq -> decoded KVEventBatch array

    def receive_until(self, batches: int, timeout_s: float = 60.0) -> None:
        """Receive until every batch below ``batches`` (the publisher's ``stats().batches``) is
        here (raises TimeoutError after ``timeout_s`` without them). With a replay endpoint, a gap
        in the sequence numbers is replayed as soon as it is seen, while the publisher still runs."""
        deadline = time.monotonic() + timeout_s
        while any(s not in self.batches for s in range(batches)):
            left = deadline - time.monotonic()
            if left <= 0 or not self.sub.poll(int(left * 1000)):
                raise TimeoutError(f"{len(self.batches)} of {batches} batches within {timeout_s}s")
            self._receive_one()

    def pump(self) -> None:
        """Receive what has arrived (filling gaps from the replay socket); never waits for more."""
        while self.sub.poll(0):
            self._receive_one()

    def pump_while(self, running, poll_ms: int = 50) -> None:
        """Receive until ``running()`` is false (a publisher's process still running)."""
        while running():
            if self.sub.poll(poll_ms):
                self._receive_one()

    def _receive_one(self) -> None:
        topic, seq, payload = self.sub.recv_multipart()
        assert topic == self.topic and len(seq) == 8
        assert seq != END, "seq -1 on the PUB socket (SGLang sends it only on the replay socket)"
        self.batches[int.from_bytes(seq, "big")] = msgspec.msgpack.decode(payload)
        if self.replay_endpoint is not None and self.missing():
            self.fill_from_replay(min(self.missing()))   # a gap (a late join): replay it now

    def missing(self) -> list[int]:
        """Sequence numbers below the highest seen that never arrived."""
        top = max(self.batches, default=-1)
        return [s for s in range(top + 1) if s not in self.batches]

    def fill_from_replay(self, start: int = 0, timeout_s: float = 30.0) -> int:
        """Ask the replay socket for every batch from ``start``; returns how many came back."""
        dealer = self.ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(self.replay_endpoint)
        try:
            dealer.send_multipart((b"", start.to_bytes(8, "big")))
            n = 0
            while True:
                if not dealer.poll(int(timeout_s * 1000)):
                    raise TimeoutError("replay did not end")
                empty, seq, payload = dealer.recv_multipart()
                assert empty == b"" and len(seq) == 8
                if seq == END:
                    assert payload == b""
                    return n
                self.batches[int.from_bytes(seq, "big")] = msgspec.msgpack.decode(payload)
                n += 1
        finally:
            dealer.close()

    def close(self) -> None:
        self.sub.close()


def events(batches: dict[int, list]):
    """Every event, in sequence order: ``(tag, fields...)`` arrays."""
    for seq in sorted(batches):
        ts, evs, rank = batches[seq]
        assert isinstance(ts, float)
        yield from evs


def pages_held(batches: dict[int, list], medium: str) -> set[int]:
    """The page ids held in ``medium`` after applying every BlockStored / BlockRemoved in order."""
    held: set[int] = set()
    for ev in events(batches):
        if ev[0] == "BlockStored" and ev[6] == medium:
            held.update(ev[1])
        elif ev[0] == "BlockRemoved" and ev[2] == medium:
            held.difference_update(ev[1])
        elif ev[0] == "AllBlocksCleared":
            held.clear()
    return held


def int64_id(page_hash: str) -> int:
    """SGLang 0.5.19 ``sglang.srt.mem_cache.utils.hash_str_to_int64``, verbatim."""
    uint64_val = int(page_hash[:16], 16)
    if uint64_val >= 2**63:
        return uint64_val - 2**64
    return uint64_val
