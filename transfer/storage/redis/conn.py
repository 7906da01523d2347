"""Opening a Redis connection: URL checks (bad URLs are refused before connecting, never misread),
password redaction for messages, and the redis-py client the stores use (hiredis parser; a
command packer that hands page buffers to the socket without copying them)."""

from __future__ import annotations

import re
from urllib.parse import parse_qs, urlsplit

import redis
from redis.backoff import NoBackoff
from redis.connection import HIREDIS_AVAILABLE, Encoder, HiredisRespSerializer, PythonRespSerializer
from redis.retry import Retry

from transfer.errors import StorageConfigError

_DB = re.compile(r"\d+\Z")


def redact(url: str) -> str:
    """``url`` without its password (for messages and logs)."""
    if "@" in url and "://" in url:
        scheme, rest = url.split("://", 1)
        return f"{scheme}://***@{rest.split('@', 1)[1]}"
    return url


def check_url(url: str) -> None:
    """Refuse what redis-py would silently misread.

    Raises:
        StorageConfigError: not ``redis://``, ``rediss://`` or ``unix://``; a non-numeric or
            out-of-range port; a database that is not a non-negative integer (``/abc``, ``?db=x``).
    """
    if not isinstance(url, str):
        raise StorageConfigError(f"redis URL must be a str, got {url!r}")
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as err:
        raise StorageConfigError(f"bad redis URL {redact(url)!r}: {err}") from None
    if parts.scheme not in ("redis", "rediss", "unix"):
        raise StorageConfigError(f"bad redis URL {redact(url)!r}: scheme must be redis://, rediss:// or unix://")
    if parts.scheme != "unix" and not parts.hostname:
        raise StorageConfigError(f"bad redis URL {redact(url)!r}: no host")
    if port is not None and not 0 < port < 65536:
        raise StorageConfigError(f"bad redis URL {redact(url)!r}: port {port}")
    dbs = parse_qs(parts.query).get("db", [])
    path = parts.path.strip("/") if parts.scheme != "unix" else ""
    for db in dbs + ([path] if path else []):
        if not _DB.match(db):
            raise StorageConfigError(f"bad redis URL {redact(url)!r}: database {db!r} is not a number")


class _ValuePacker:
    """redis-py command packer: a command carrying a page (a memoryview) is packed by redis-py's
    Python packer, which hands the page to the socket as it is (hiredis's packer would copy it
    twice); every other command by hiredis's C packer when installed. Replies are parsed by
    hiredis either way."""

    def __init__(self) -> None:
        self._py = PythonRespSerializer(6000, Encoder("utf-8", "strict", False).encode)
        self._c = HiredisRespSerializer() if HIREDIS_AVAILABLE else self._py

    def pack(self, *args):
        for arg in args:
            if type(arg) is memoryview:
                return self._py.pack(*args)
        return self._c.pack(*args)


def _client_from_url(url: str, connect_timeout_s: float, socket_timeout_s: float) -> redis.Redis:
    packer = _ValuePacker()
    return redis.Redis.from_url(
        url, socket_connect_timeout=connect_timeout_s, socket_timeout=socket_timeout_s,
        retry=Retry(NoBackoff(), 1), retry_on_error=[], health_check_interval=0, command_packer=packer)
