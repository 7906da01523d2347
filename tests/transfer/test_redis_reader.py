"""The Redis read path at wire level (``transfer/storage/redis/reader.py``) against a real
``redis-server``: replies read straight into page tensors, and every way a reply can go wrong —
an error reply mid-pipeline, nil, a value of the wrong length, a connection cut mid-value, bytes
the reader did not ask for — is a miss or a typed error, never a wrong page and never a half-read
connection handed to the next caller."""

from __future__ import annotations

import socket
import threading
import time

import pytest
import redis
import torch
from redis.cluster import RedisCluster as ClusterClient

from lifecycle_tools.testkit.redis_cluster import redis_cluster  # noqa: F401 (fixture)
from transfer import StorageUnavailable
from transfer.storage.integrity import raw_format, seal
from transfer.storage.redis.store import HEADER_NBYTES, RedisStorage
from transfer.storage.redis.cluster import RedisClusterStorage, node_url
from transfer.storage.redis.reader import GetReader, ProtocolError, _Wire, pack_gets

NB = 4096
SUF = "_r_0_1"


def page(i: int, nb: int = NB) -> torch.Tensor:
    g = torch.Generator().manual_seed(i)
    return torch.randint(0, 256, (nb,), dtype=torch.uint8, generator=g)


def key(i: int) -> str:
    return f"{i:064x}"


def filled(n: int, nb: int = NB) -> list[torch.Tensor]:
    return [torch.full((nb,), 0xAB, dtype=torch.uint8) for _ in range(n)]


def test_values_land_in_the_tensors_of_any_dtype_and_size(redis_url):
    s = RedisStorage(redis_url, SUF)
    pages = [page(1, 16), page(2, 300 << 10), page(3, 1 << 20).view(torch.bfloat16).reshape(2, -1)]
    keys = [key(1), key(2), key(3)]
    assert s.batch_set(keys, pages) == [True] * 3
    out = [torch.empty_like(p) for p in pages]
    assert s.batch_get(keys, out) == [True] * 3
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(pages, out))
    s.close()


def test_error_reply_and_nil_mid_pipeline_are_misses_the_rest_is_read(redis_url):
    s = RedisStorage(redis_url, SUF, NB)
    keys = [key(i) for i in range(5)]
    assert all(s.batch_set([keys[0], keys[2], keys[4]], [page(0), page(2), page(4)]))
    c = redis.Redis.from_url(redis_url)
    c.rpush(keys[1] + SUF, b"x")  # GET on a list: WRONGTYPE error reply in the middle
    out = filled(5)
    assert s.batch_get(keys, out) == [True, False, True, False, True]  # key 3: nil
    assert torch.equal(out[0], page(0)) and torch.equal(out[2], page(2)) and torch.equal(out[4], page(4))
    assert (out[1] == 0xAB).all() and (out[3] == 0xAB).all()  # misses: not written
    st = s.stats()
    assert st.errors == 1 and st.hits == 3 and st.misses == 2
    assert s.batch_get(keys[:1], out[:1]) == [True]  # the connection is still in step
    c.close()
    s.close()


def test_wrong_length_values_are_misses_and_never_written(redis_url):
    s = RedisStorage(redis_url, SUF, NB)
    c = redis.Redis.from_url(redis_url)
    big = page(7, 2 * NB)
    c.set(key(1) + SUF, seal(key(1) + SUF, raw_format(big), big.numpy()) + big.numpy().tobytes())  # a bigger page
    whole = seal(key(2) + SUF, raw_format(page(2)), page(2).numpy()) + page(2).numpy().tobytes()
    c.set(key(2) + SUF, whole[:-1])  # truncated by one byte
    c.set(key(3) + SUF, whole + b"!")  # one byte too many
    c.set(key(4) + SUF, whole[:HEADER_NBYTES - 1])  # shorter than a seal
    c.set(key(5) + SUF, b"")  # empty
    assert s.batch_set([key(6)], [page(6)]) == [True]
    keys = [key(i) for i in (1, 2, 3, 4, 5, 6)]
    out = filled(6)
    assert s.batch_get(keys, out) == [False] * 5 + [True]
    assert all((t == 0xAB).all() for t in out[:5]) and torch.equal(out[5], page(6))
    st = s.stats()
    assert st.wrong_size == 1 and st.corrupt == 4
    c.close()
    s.close()


def test_same_length_bad_page_is_zeroed_in_the_tensor(redis_url):
    s = RedisStorage(redis_url, SUF, NB)
    assert s.batch_set([key(1)], [page(1)]) == [True]
    c = redis.Redis.from_url(redis_url)
    c.setrange(key(1) + SUF, HEADER_NBYTES + NB - 1, b"\x00" if page(1)[-1] else b"\x01")  # last byte
    out = filled(1)
    assert s.batch_get([key(1)], out) == [False]
    assert (out[0] == 0).all()  # read in place, refused, zeroed: none of its bytes are left
    assert s.stats().corrupt == 1
    c.close()
    s.close()


class CuttingProxy:
    """A TCP proxy in front of a real server that closes the first connection after passing
    ``cut`` bytes of the server's replies to GET commands (the connection handshake before them is
    not counted); later connections pass everything."""

    def __init__(self, port: int, cut: int) -> None:
        self.port, self.cut = port, cut
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"redis://127.0.0.1:{self.listener.getsockname()[1]}/0"
        self.connections = 0
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                down, _ = self.listener.accept()
            except OSError:
                return
            up = socket.create_connection(("127.0.0.1", self.port))
            first, got = self.connections == 0, threading.Event()
            self.connections += 1
            threading.Thread(target=self._pump, args=(down, up, None, got), daemon=True).start()
            threading.Thread(target=self._pump, args=(up, down, self.cut if first else None, got),
                             daemon=True).start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket, limit: int | None, got: threading.Event) -> None:
        counted = 0
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                if limit is None and b"GET" in data:
                    got.set()
                elif limit is not None and got.is_set():
                    data = data[:limit - counted]
                    counted += len(data)
                dst.sendall(data)
                if limit is not None and counted >= limit:
                    break
        except OSError:
            pass
        for sock in (src, dst):
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            sock.close()

    def close(self) -> None:
        self.listener.close()


@pytest.mark.parametrize("cut_at", ["line", "seal", "body"])
def test_connection_cut_mid_reply_is_unavailable_and_leaves_no_partial_page(redis_url, cut_at):
    nb = 256 << 10
    writer = RedisStorage(redis_url, SUF, nb)
    keys = [key(i) for i in range(3)]
    pages = [page(i, nb) for i in range(3)]
    assert writer.batch_set(keys, pages) == [True] * 3
    reply = len(f"${HEADER_NBYTES + nb}\r\n") + HEADER_NBYTES + nb + 2
    cut = reply + {"line": 3, "seal": 20, "body": 1000 + nb // 2}[cut_at]  # in the second reply
    port = int(redis_url.rsplit(":", 1)[1].split("/")[0])
    proxy = CuttingProxy(port, cut)
    s = RedisStorage(proxy.url, SUF, nb, check=False)
    out = filled(3, nb)
    with pytest.raises(StorageUnavailable, match="unreachable"):
        s.batch_get(keys, out)
    assert (out[1] == 0).all() or (out[1] == 0xAB).all()  # the cut page: none of its bytes left
    time.sleep(s.breaker.retry_in())  # after its backoff the next call is the probe that closes it
    out = filled(3, nb)
    assert s.batch_get(keys, out) == [True] * 3  # a fresh connection, nothing half-read on it
    assert all(torch.equal(a, b) for a, b in zip(pages, out)) and proxy.connections == 2
    s.close()
    writer.close()
    proxy.close()


def scripted_server(answer: bytes, close_after: bool = False) -> tuple[socket.socket, str]:
    """A peer that answers any request with ``answer`` (the reply a real server never sends);
    ``close_after``: then it ends its side, so a reader that reads past ``answer`` fails at once."""
    listener = socket.create_server(("127.0.0.1", 0))

    def serve():
        conn, _ = listener.accept()
        while True:
            data = conn.recv(65536)
            if not data:  # the client dropped the connection
                break
            if b"HELLO" in data:  # RESP3 handshake
                conn.sendall(b"%1\r\n$5\r\nproto\r\n:3\r\n")
            elif b"GET" in data:
                conn.sendall(answer)
                if close_after:
                    conn.shutdown(socket.SHUT_WR)
            else:  # the client's handshake (CLIENT SETINFO ...): OK to each command
                conn.sendall(b"+OK\r\n" * (data.count(b"\r\n*") + data.startswith(b"*")))
        conn.close()

    threading.Thread(target=serve, daemon=True).start()
    return listener, f"redis://127.0.0.1:{listener.getsockname()[1]}/0"


@pytest.mark.parametrize("answer", [b"*1\r\n$1\r\nx\r\n", b"$x1\r\n", b"$3\r\nabcXY", b":1\r\n",
                                    b"$1\r\nab\r\n", b"$" + b"9" * 5000, b"+OK\r\n", b">1\r\n$x\r\n",
                                    b"%0\r\n\r\n",  # an empty RESP3 map, not a bulk string
                                    # a one-byte value whose terminator is not CRLF:
                                    b"$1\r\naX\n", b"$1\r\na\x0e\n", b"$1\r\n\n\rX", b"$1\r\na\rX\n",
                                    b"$1\r\na\rX", b"$1\r\na\r\x0b"])
def test_a_reply_that_is_not_a_get_reply_is_a_protocol_error_and_drops_the_connection(answer):
    listener, url = scripted_server(answer)
    client = redis.Redis.from_url(url, socket_timeout=2)
    dest = bytearray(8)
    with pytest.raises(ProtocolError):
        GetReader(HEADER_NBYTES).get_into(client, [b"k"], None, [memoryview(dest)], lambda j, r, h: None)
    pool = client.connection_pool
    assert not pool._in_use_connections and all(c._sock is None for c in pool._available_connections)
    assert dest == bytearray(8)
    client.close()
    listener.close()


def get_two(answer: bytes) -> list:
    """``get_into`` of two names against a peer answering ``answer`` then closing its side: the
    second reply is already buffered when the first is done (the reader's common case)."""
    listener, url = scripted_server(answer, close_after=True)
    client = redis.Redis.from_url(url, socket_timeout=2)
    try:
        return GetReader(HEADER_NBYTES).get_into(client, [b"j", b"k"], None, [memoryview(bytearray(8))] * 2,
                                                 lambda j, r, h: None)
    finally:
        client.close()
        listener.close()


@pytest.mark.parametrize("line", [b"$x1", b"$" + b"9x" * 30])
@pytest.mark.parametrize("after_a_nil", [False, True])
def test_a_bad_bulk_length_reply_is_named_in_the_error(line, after_a_nil):
    with pytest.raises(ProtocolError, match=r"^bad bulk length ") as err:
        get_two(b"$-1\r\n" + line + b"\r\n") if after_a_nil else get_one(line + b"\r\n")
    assert str(err.value).endswith(repr(line[:40]))  # the line quoted, cut at 40 bytes


def test_an_empty_map_after_a_nil_is_not_taken_for_an_empty_value():
    assert get_two(b"$-1\r\n$0\r\n\r\n") == [None, 0]  # an empty value: its length, 0
    with pytest.raises(ProtocolError, match=r"^unexpected reply to GET: b'%0'$"):
        get_two(b"$-1\r\n%0\r\n\r\n")  # a RESP3 map is not a reply to GET, even when buffered


def test_nil_and_error_replies_are_handed_over_with_an_empty_head_and_any_error_text():
    """``on_reply`` gets nil as None and an error reply as the server's error (its text decoded
    even when it is not UTF-8), each with an empty head; the values after them are still read."""
    listener, url = scripted_server(b"$-1\r\n-ERR bad \xff\xfe key\r\n$2\r\nok\r\n")
    client = redis.Redis.from_url(url, socket_timeout=2)
    seen = []
    replies = GetReader(HEADER_NBYTES).get_into(client, [b"a", b"b", b"c"], None, [memoryview(bytearray(8))] * 3,
                                                lambda j, r, h: seen.append((j, r, bytes(h))))
    assert replies[0] is None and isinstance(replies[1], redis.ResponseError) and replies[2] == 2
    assert str(replies[1]) == "bad \ufffd\ufffd key"  # ERR is the error's kind, the rest its text
    assert seen == [(0, None, b""), (1, replies[1], b""), (2, 2, b"ok")]
    client.close()
    listener.close()


def test_page_bytes_that_look_like_reply_framing_are_read_as_page_bytes(redis_url):
    s = RedisStorage(redis_url, SUF, NB)
    framing = (b"XX\r\nXX$-1\r\n-ERR x\r\n$3\r\nabc\r\n>1\r\n" * NB)[:NB]
    tricky = torch.frombuffer(bytearray(framing), dtype=torch.uint8)
    assert s.batch_set([key(8), key(7)], [page(8), tricky]) == [True, True]
    out = filled(2)
    assert s.batch_get([key(8), key(7)], out) == [True, True]  # the second reply arrives with the first
    assert torch.equal(out[0], page(8)) and torch.equal(out[1], tricky)
    s.close()


def test_a_seal_split_across_receives_is_read_whole():
    """A buffer refill can end inside a value's seal: the seal is completed from the socket."""
    body = bytes(range(8))
    value = seal("k", raw_format(torch.frombuffer(bytearray(body), dtype=torch.uint8)), body) + body
    a, b = socket.socketpair()
    b.sendall(b"$%d\r\n" % len(value) + value + b"\r\n")
    b.shutdown(socket.SHUT_WR)
    line_nbytes = len(b"$%d\r\n" % len(value))
    wire = _Wire(a, bytearray(line_nbytes + HEADER_NBYTES - 1))  # the first receive ends 1 byte short of the seal
    head, dest, seen = memoryview(bytearray(HEADER_NBYTES)), memoryview(bytearray(8)), []
    assert GetReader(HEADER_NBYTES)._one(wire, head, dest, 0, lambda j, r, h: seen.append(bytes(h))) == len(value)
    assert seen == [value[:HEADER_NBYTES]] and bytes(dest) == body
    a.close()
    b.close()


def test_ttl_reads_use_getex(redis_url):
    s = RedisStorage(redis_url, SUF, NB, ttl_s=100)
    assert s.batch_set([key(1)], [page(1)]) == [True]
    c = redis.Redis.from_url(redis_url)
    c.pexpire(key(1) + SUF, 5000)
    out = filled(1)
    assert s.batch_get([key(1)], out) == [True] and torch.equal(out[0], page(1))
    assert c.pttl(key(1) + SUF) > 50_000  # refreshed by the read
    c.close()
    s.close()


def test_a_push_before_the_reply_is_skipped_and_extra_bytes_drop_the_connection():
    listener, url = scripted_server(b">2\r\n$4\r\nnote\r\n*1\r\n:1\r\n_\r\n+extra\r\n")  # push, nil, extra
    client = redis.Redis.from_url(url, socket_timeout=2)
    seen = []
    assert GetReader(HEADER_NBYTES).get_into(client, [b"k"], None, [memoryview(bytearray(8))],
                                             lambda j, r, h: seen.append((j, r))) == [None]
    assert seen == [(0, None)]
    pool = client.connection_pool
    assert all(c._sock is None for c in pool._available_connections)  # not trusted after the extra bytes
    client.close()
    listener.close()


def test_cluster_slot_moved_under_a_stale_map_is_followed_by_writes_and_reads(redis_cluster):
    """Regression: a ``MOVED`` reply (redis-py's ``MovedError``, whose text is only "slot host:port")
    was never recognised by the cluster write path, so a write after a slot moved was a failure."""
    writer = RedisClusterStorage(redis_cluster.url, SUF, NB)
    reader = RedisClusterStorage(redis_cluster.url, SUF, NB)  # both cache the slot map now
    k = key(0xC1)
    name = (k + SUF).encode()
    admin = ClusterClient.from_url(node_url(redis_cluster.url))
    slot, owner = admin.keyslot(name), admin.get_node_from_key(name)
    target = next(n for n in admin.get_primaries() if n.name != owner.name)
    target_id = admin.get_redis_connection(target).execute_command("CLUSTER", "MYID")
    for node in [target, owner] + [n for n in admin.get_primaries() if n.name not in (target.name, owner.name)]:
        admin.get_redis_connection(node).execute_command("CLUSTER", "SETSLOT", slot, "NODE", target_id)
    assert writer.batch_set([k], [page(0xC1)]) == [True]  # MOVED: map refreshed, resent to the new owner
    out = filled(1)
    assert reader.batch_get([k], out) == [True] and torch.equal(out[0], page(0xC1))  # the same for reads
    assert writer.stats().errors == 0 and reader.stats().errors == 0
    assert admin.get_redis_connection(target).exists(name) == 1
    admin.close()
    writer.close()
    reader.close()


def get_one(answer: bytes) -> list:
    """``get_into`` of one name against a peer answering ``answer`` and then closing its side."""
    listener, url = scripted_server(answer, close_after=True)
    client = redis.Redis.from_url(url, socket_timeout=2)
    try:
        return GetReader(HEADER_NBYTES).get_into(client, [b"k"], None, [memoryview(bytearray(8))],
                                                 lambda j, r, h: None)
    finally:
        client.close()
        listener.close()


@pytest.mark.parametrize("before", [
    b">0\r\n",                                    # an empty push
    b"|1\r\n:1\r\n:2\r\n",                        # an attribute: one key and its value
    b">1\r\n%1\r\n:1\r\n:2\r\n",                  # a push holding a map (key, value)
    b">1\r\n|1\r\n:1\r\n:2\r\n",                  # ... an attribute
    b">1\r\n>1\r\n:1\r\n",                        # ... a push
    b">1\r\n~1\r\n:1\r\n",                        # ... a set
    b">1\r\n*1\r\n:1\r\n",                        # ... an array
    b">1\r\n=8\r\ntxt:abcd\r\n",                   # ... a verbatim string
    b">1\r\n!5\r\nERR x\r\n",                      # ... a blob error
    b">2\r\n*-1\r\n$2\r\nab\r\n",                 # ... a null array and a bulk string
])
def test_resp3_pushes_and_attributes_before_a_reply_are_skipped_element_by_element(before):
    assert get_one(before + b"$-1\r\n") == [None]
    assert get_one(before + b"$3\r\nabc\r\n") == [3]  # a value after it: its length


@pytest.mark.parametrize("answer, bad", [
    (b">x\r\n", b">x"), (b">" + b"x" * 60 + b"\r\n", b">" + b"x" * 60),
])
def test_a_bad_aggregate_length_is_named_in_the_error(answer, bad):
    with pytest.raises(ProtocolError, match=r"^bad aggregate length ") as err:
        get_one(answer)
    assert str(err.value).endswith(repr(bad[:40]))  # the line quoted, cut at 40 bytes


@pytest.mark.parametrize("item", [b"$x", b"$" + b"9x" * 30])
def test_a_bad_bulk_length_inside_a_push_is_named_in_the_error(item):
    with pytest.raises(ProtocolError, match=r"^bad bulk length ") as err:
        get_one(b">1\r\n" + item + b"\r\n")
    assert str(err.value).endswith(repr(item[:40]))


def test_skip_drops_exactly_the_bytes_asked_for_across_buffer_refills():
    a, b = socket.socketpair()
    b.sendall(b"line1\r\n" + b"0123456789ABCDEFGHIJ" + b"next\r\n" + b"abcdefghij" * 5 + b"last\r\n")
    b.shutdown(socket.SHUT_WR)  # reading past the end fails at once instead of waiting
    wire = _Wire(a, bytearray(16))  # a small buffer: the skips need several receives
    assert wire.line() == b"line1"  # the buffer now holds part of the next 20 bytes
    wire.skip(20)
    assert wire.line() == b"next"
    wire.skip(50)  # more than the buffer: whole-buffer receives, then the exact rest
    assert wire.line() == b"last"
    with pytest.raises(redis.ConnectionError):
        wire.line()
    a.close()
    b.close()


def test_crlf_consumes_exactly_the_terminator_and_refuses_anything_else():
    a, b = socket.socketpair()
    b.sendall(b"abc\r\n\r\nnext\r\nXY")
    wire = _Wire(a, bytearray(64))
    assert wire.line() == b"abc"
    wire.crlf()
    assert wire.line() == b"next"  # exactly the two bytes were consumed
    with pytest.raises(ProtocolError, match=r"^bulk string not terminated by CRLF$"):
        wire.crlf()
    a.close()
    b.close()


def test_crlf_split_across_receives_keeps_the_bytes_already_buffered():
    a, b = socket.socketpair()
    b.sendall(b"abc\r\nX\r")  # the value's last byte and half of its CRLF
    wire = _Wire(a, bytearray(8))
    assert wire.line() == b"abc"
    dst = bytearray(1)
    wire.into(memoryview(dst))
    assert dst == b"X"
    b.sendall(b"\nnext\r\n")  # the rest arrives in a later receive
    b.shutdown(socket.SHUT_WR)
    wire.crlf()
    assert wire.line() == b"next"
    a.close()
    b.close()


@pytest.mark.parametrize("line", [b"", b"+" + b"x" * 60])
def test_an_unexpected_reply_line_is_quoted_in_the_error(line):
    with pytest.raises(ProtocolError, match=r"^unexpected reply to GET: ") as err:
        get_one(line + b"\r\n")  # an empty line, a long simple string: neither is a reply to GET
    assert str(err.value).endswith(repr(line[:40]))


def test_a_partial_line_deep_in_the_buffer_is_kept_and_completed_by_the_next_receive():
    a, b = socket.socketpair()
    b.sendall(b"$4500\r\n" + b"v" * 4500 + b"ab")  # a reply line, its value, the start of the next line
    wire = _Wire(a, bytearray(8192))
    assert wire.line() == b"$4500"  # one receive: all of it is buffered now
    wire.skip(4500)  # the buffer now holds only "ab", far from its start
    b.sendall(b"c\r\n")
    b.shutdown(socket.SHUT_WR)
    assert wire.line() == b"abc"
    with pytest.raises(redis.ConnectionError, match=r"^Connection closed by server while reading a reply\.$"):
        wire.line()
    a.close()
    b.close()


def test_a_line_longer_than_the_limit_is_refused_by_name():
    a, b = socket.socketpair()
    b.sendall(b"$" + b"9" * 5000)
    wire = _Wire(a, bytearray(8192))
    with pytest.raises(ProtocolError, match=r"^reply line longer than 4096 bytes$"):
        wire.line()
    a.close()
    b.close()
