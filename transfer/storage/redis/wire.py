"""The Redis write path at wire level: a whole pipeline of ``SET name value NX [PX ms]`` packed into
one reusable buffer (each page copied once, from its tensor, next to its seal) and sent with one
``sendall``; the replies read back with redis-py's parser (hiredis when installed).

redis-py's own pipeline either copies every value twice (hiredis's packer) or sends every value
as its own ``sendall`` (the Python packer): on a 2-core machine the extra syscalls or copies cost
more than the store's seal. This module uses only redis-py's public connection API
(``ConnectionPool.get_connection`` / ``release``, ``Connection.send_packed_command`` /
``read_response``).
"""

from __future__ import annotations

import threading

import redis
from redis.exceptions import ResponseError


class SetBatch:
    """Packs ``SET ... NX`` commands into a per-thread buffer that is reused between batches.

    ``add`` returns the view of the value (seal + page) inside the buffer, valid until the next
    ``start`` on this thread.
    """

    def __init__(self) -> None:
        self._local = threading.local()

    def start(self, names: list[bytes], value_nbytes: list[int], ttl_ms: int | None) -> None:
        """Size the buffer for these commands (grown, never shrunk, per thread)."""
        tail = b"\r\n$2\r\nNX\r\n"
        if ttl_ms is not None:
            ms = b"%d" % ttl_ms
            tail += b"$2\r\nPX\r\n$%d\r\n%s\r\n" % (len(ms), ms)
        argc = 6 if ttl_ms is not None else 4  # SET name value NX [PX ms]
        heads = [b"*%d\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n" % (argc, len(n), n, v) for n, v in zip(names, value_nbytes)]
        total = sum(len(h) for h in heads) + sum(value_nbytes) + len(tail) * len(names)
        buf = getattr(self._local, "buf", None)
        if buf is None or len(buf) < total:
            buf = self._local.buf = bytearray(total)
        self._local.view, self._local.pos = memoryview(buf), 0
        self._local.heads, self._local.tail, self._local.total = heads, tail, total

    def add(self, j: int, seal: bytes, raw: memoryview) -> memoryview:
        """Append command ``j``: its head, ``seal`` and the page bytes ``raw`` (one copy)."""
        loc = self._local
        view, pos, head = loc.view, loc.pos, loc.heads[j]
        view[pos:pos + len(head)] = head
        pos += len(head)
        start = pos
        view[pos:pos + len(seal)] = seal
        pos += len(seal)
        view[pos:pos + raw.nbytes] = raw
        pos += raw.nbytes
        view[pos:pos + len(loc.tail)] = loc.tail
        loc.pos = pos + len(loc.tail)
        return view[start:pos]

    def payload(self) -> memoryview:
        """The packed commands (after every ``add``)."""
        return self._local.view[: self._local.total]


def send_and_read(client: redis.Redis, payload: memoryview, n: int) -> list:
    """Send ``payload`` (``n`` packed commands) on one pooled connection and read ``n`` replies.

    Returns:
        Per command, its reply, or the ``ResponseError`` the server answered with.
    Raises:
        redis ConnectionError / TimeoutError, OSError: the connection failed (it is dropped).
    """
    pool = client.connection_pool
    conn = pool.get_connection()
    try:
        conn.send_packed_command([payload], check_health=False)
        replies = []
        for _ in range(n):
            try:
                replies.append(conn.read_response())
            except ResponseError as err:
                replies.append(err)
        return replies
    except BaseException:
        conn.disconnect()  # a half-read connection must not go back to the pool in use
        raise
    finally:
        pool.release(conn)
