"""The Redis read path at wire level: a pipeline of ``GET`` (or ``GETEX``) sent with one write, and
the bulk replies read from the socket straight into the caller's page memory.

A value is ``seal + page bytes``. Its first ``head_nbytes`` bytes (the seal) land in a small
reusable buffer; when the value has exactly ``head_nbytes + len(dest)`` bytes the rest lands in
``dest`` (the caller's page tensor) — the page is copied once, kernel to tensor, with no reply
``bytes`` object in between, and the caller can hash it in place while it is still in cache. A
value of any other length is read and dropped (its seal is still handed over, so the caller can
say why it is refused); ``dest`` is then not written at all.

Only redis-py's public pool API is used to obtain a connection (``ConnectionPool.get_connection``
/ ``release``, ``Connection.send_packed_command``, ``disconnect``); the replies are read from the
connection's socket, which the pool hands out with nothing pending (it checks). Any failure while
reading — the server closing the connection, a timeout, a reply that is not a bulk string, nil or
error, bytes left over after the last reply — drops the connection (``disconnect``) before it goes
back to the pool, so a half-read reply never reaches the next user of that connection.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

import redis
from redis._parsers import BaseParser
from redis.exceptions import ConnectionError as RedisConnectionError

BUFFER_NBYTES = 256 << 10  # socket read buffer: reply lines, seals and small values (fewer receives)
DIRECT_NBYTES = 32 << 10  # a value's rest at least this big is received in place, smaller ones buffered
MAX_LINE = 4096  # longest reply line accepted (error messages are far shorter)

# on_reply(j, reply, head): reply is the value's length (int), None (nil) or the server's error
# (an exception object); head is the value's first min(length, head_nbytes) bytes (empty otherwise).
OnReply = Callable[[int, object, memoryview], None]


class ProtocolError(RedisConnectionError):
    """The server answered something that is not a reply to ``GET`` (the connection is dropped)."""


def pack_gets(names: Sequence[bytes], ttl_ms: int | None) -> bytes:
    """``GET name`` per name (``GETEX name PX ttl_ms`` when ``ttl_ms`` is set), RESP-packed."""
    if ttl_ms is None:
        return b"".join(b"*2\r\n$3\r\nGET\r\n$%d\r\n%s\r\n" % (len(n), n) for n in names)
    ms = b"%d" % ttl_ms
    tail = b"$2\r\nPX\r\n$%d\r\n%s\r\n" % (len(ms), ms)
    return b"".join(b"*4\r\n$5\r\nGETEX\r\n$%d\r\n%s\r\n%s" % (len(n), n, tail) for n in names)


class _Wire:
    """Buffered reads from one socket: reply lines from a small buffer, values straight into the
    caller's memory (what the buffer already holds is copied, the rest received in place)."""

    def __init__(self, sock, buf: bytearray) -> None:
        self.sock, self.buf, self.view = sock, buf, memoryview(buf)
        self.pos = self.end = 0

    def _recv(self, into: memoryview) -> int:
        n = self.sock.recv_into(into)
        if n == 0:
            raise RedisConnectionError("Connection closed by server while reading a reply.")
        return n

    def line(self) -> bytes:
        """The next reply line, without its CRLF."""
        while True:
            i = self.buf.find(b"\r\n", self.pos, self.end)
            if i >= 0:
                line = bytes(self.view[self.pos:i])
                self.pos = i + 2
                return line
            if self.end - self.pos > MAX_LINE:
                raise ProtocolError(f"reply line longer than {MAX_LINE} bytes")
            if self.pos:  # keep the partial line at the front
                left = self.end - self.pos
                self.buf[:left] = self.view[self.pos:self.end]
                self.pos, self.end = 0, left
            self.end += self._recv(self.view[self.end:])

    def into(self, dst: memoryview) -> None:
        """Fill ``dst`` exactly with the next ``len(dst)`` bytes."""
        n = dst.nbytes
        have = min(self.end - self.pos, n)
        if have:
            dst[:have] = self.view[self.pos:self.pos + have]
            self.pos += have
        while have < n:
            if n - have >= DIRECT_NBYTES:  # big: straight from the socket into dst
                have += self._recv(dst[have:])
            else:  # small rest: one receive of whatever is there (it may hold the next replies)
                self.pos, self.end = 0, self._recv(self.view)
                take = min(self.end, n - have)
                dst[have:have + take] = self.view[:take]
                self.pos, have = take, have + take

    def skip(self, n: int) -> None:
        """Drop the next ``n`` bytes."""
        have = min(self.end - self.pos, n)
        self.pos += have
        while have < n:
            self.pos = self.end = 0
            have += self._recv(self.view[:min(n - have, len(self.buf))])

    def crlf(self) -> None:
        """The CRLF that ends a bulk string."""
        while self.end - self.pos < 2:
            if self.pos:
                left = self.end - self.pos
                self.buf[:left] = self.view[self.pos:self.end]
                self.pos, self.end = 0, left
            self.end += self._recv(self.view[self.end:])
        if self.view[self.pos:self.pos + 2] != b"\r\n":
            raise ProtocolError("bulk string not terminated by CRLF")
        self.pos += 2


class GetReader:
    """Reads ``GET`` pipelines into caller buffers; one read buffer and one seal buffer per thread.

    Args:
        head_nbytes: bytes at the start of every value handed to ``on_reply`` (the seal).
    """

    def __init__(self, head_nbytes: int) -> None:
        self.head_nbytes = head_nbytes
        self._local = threading.local()

    def _buffers(self) -> tuple[bytearray, memoryview]:
        loc = self._local
        if getattr(loc, "buf", None) is None:
            loc.buf, loc.head = bytearray(BUFFER_NBYTES), memoryview(bytearray(self.head_nbytes))
        return loc.buf, loc.head

    def get_into(self, client: redis.Redis, names: Sequence[bytes], ttl_ms: int | None,
                 dests: Sequence[memoryview], on_reply: OnReply) -> list:
        """Send ``GET names[j]`` for every j on one pooled connection and read the replies.

        A value of exactly ``head_nbytes + dests[j].nbytes`` bytes is read into the seal buffer
        and ``dests[j]`` (writable, C-contiguous bytes); any other value is read and dropped.
        ``on_reply`` is called as soon as reply j is complete (the seal buffer is reused after it
        returns).

        Returns:
            Per name: the value's length, None (no such key), or the error the server answered.
        Raises:
            redis ConnectionError (``ProtocolError`` included) / TimeoutError, OSError: the
            connection failed or the server's answer is not a reply to ``GET``; the connection
            is dropped. ``dests[j]`` of the reply being read may hold part of a value.
        """
        buf, head = self._buffers()
        pool = client.connection_pool
        conn = pool.get_connection()
        try:
            conn.send_packed_command([pack_gets(names, ttl_ms)], check_health=False)
            wire = _Wire(conn._sock, buf)  # noqa: SLF001 (the socket the pool checked clean)
            replies = [self._one(wire, head, dests[j], j, on_reply) for j in range(len(names))]
            if wire.pos != wire.end:  # more than was asked for: the connection is not trusted
                conn.disconnect()
            return replies
        except BaseException:
            conn.disconnect()  # never hand a half-read reply to the connection's next user
            raise
        finally:
            pool.release(conn)

    def _one(self, wire: _Wire, head: memoryview, dest: memoryview, j: int, on_reply: OnReply):
        buf, pos = wire.buf, wire.pos
        i = buf.find(b"\r\n", pos, wire.end)
        if i > pos and buf[pos] == 36:  # b"$", the whole line buffered: the common case, inline
            line = None
            try:
                length = int(buf[pos + 1:i])
            except ValueError:
                raise ProtocolError(f"bad bulk length {bytes(buf[pos:i])[:40]!r}") from None
            wire.pos = i + 2
        else:
            line = wire.line()
            while line[:1] in (b">", b"|"):  # RESP3 push / attribute: not the reply, skip it
                _skip_aggregate(wire, line)
                line = wire.line()
            length = self._length(line)
        if length is None or length < 0:  # nil, or an error reply
            reply = None if line is None or line[:1] != b"-" else BaseParser.parse_error(
                line[1:].decode("utf-8", "replace"))
            on_reply(j, reply, head[:0])
            return reply
        got = head if length >= self.head_nbytes else head[:length]
        pos = wire.pos
        if wire.end - pos >= got.nbytes:  # the seal is buffered (the common case): copy it here
            got[:] = wire.view[pos:pos + got.nbytes]
            wire.pos = pos + got.nbytes
        else:
            wire.into(got)
        rest = length - got.nbytes
        if rest == dest.nbytes and got.nbytes == self.head_nbytes:
            wire.into(dest)
        else:
            wire.skip(rest)
        if wire.end - wire.pos >= 2 and buf[wire.pos] == 13 and buf[wire.pos + 1] == 10:
            wire.pos += 2
        else:
            wire.crlf()
        on_reply(j, length, got)
        return length

    @staticmethod
    def _length(line: bytes) -> int | None:
        """A bulk length from a reply line; None for nil (``$-1`` / RESP3 ``_``) and error replies."""
        kind = line[:1]
        if kind == b"$":
            try:
                return int(line[1:])
            except ValueError:
                raise ProtocolError(f"bad bulk length {line[:40]!r}") from None
        if kind == b"-" or line == b"_":
            return None
        raise ProtocolError(f"unexpected reply to GET: {line[:40]!r}")


def _skip_aggregate(wire: _Wire, line: bytes) -> None:
    """Read and drop the elements of the RESP3 aggregate whose first line is ``line``."""
    try:
        count = int(line[1:])
    except ValueError:
        raise ProtocolError(f"bad aggregate length {line[:40]!r}") from None
    count *= 2 if line[:1] in (b"%", b"|") else 1
    for _ in range(max(count, 0)):
        item = wire.line()
        kind = item[:1]
        if kind in (b"$", b"=", b"!"):
            try:
                wire.skip(int(item[1:]) + 2)
            except ValueError:
                raise ProtocolError(f"bad bulk length {item[:40]!r}") from None
        elif kind in (b"*", b">", b"~", b"%", b"|"):
            _skip_aggregate(wire, item)
